"""The preference losses against TRL's own code (the reference implementation), on identical batches:
random log-prob tensors, and real logits of a tiny model. Agreement within 1e-5.

TRL's trainers are built without their __init__ (which wants datasets and a full Trainer); the loss methods
run unchanged on an object holding only the attributes they read (tests/trainer/pref_helpers.trl_object).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.trainer.pref_helpers import LogProbsModel, random_pairs, random_sequences, trl_object, trl_padded
from trainer.batch.collate import Collator
from trainer.batch.labels import IGNORE
from trainer.objectives.dpo import DPO, dpo_loss
from trainer.objectives.kto import KTO, kto_loss
from trainer.objectives.orpo import ORPO, odds_ratio_loss
from trainer.objectives.simpo import SimPO, simpo_loss

TOL = dict(rtol=1e-5, atol=1e-5)


def random_per_token(sequences, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL-shaped per-token log-probs [n, T-1] (zero outside the completion), their sums and token counts."""
    g = torch.Generator().manual_seed(seed)
    padded = trl_padded(sequences)
    mask = padded["completion_mask"][:, 1:].bool()
    per_token = -torch.rand(mask.shape, generator=g, dtype=torch.float32) * 4 * mask
    return per_token, per_token.sum(1), mask.sum(1).float()


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_and_ipo_match_trl_on_random_log_probs(loss_type):
    from trl import DPOTrainer

    pairs = random_pairs(6, seed=1, with_ref=True)
    sequences = [(p["chosen_input_ids"], p["chosen_labels"]) for p in pairs] + \
                [(p["rejected_input_ids"], p["rejected_labels"]) for p in pairs]
    per_token, sums, counts = random_per_token(sequences, seed=2)
    ref = torch.tensor([p["ref"] for p in pairs])
    beta = 0.3
    model = LogProbsModel(per_token)
    trl = trl_object(DPOTrainer, model, loss_types=[loss_type], loss_weights=[1.0], beta=beta, label_smoothing=0.0,
                     ld_alpha=None, f_divergence_type="reverse_kl", use_weighting=False)
    inputs = {**trl_padded(sequences), "ref_chosen_logps": ref[:, 0], "ref_rejected_logps": ref[:, 1]}
    expected = trl._compute_loss(model, inputs, return_outputs=False)

    losses, chosen_rewards, rejected_rewards = dpo_loss(sums[:6], sums[6:], ref[:, 0], ref[:, 1], beta,
                                                        ipo=loss_type == "ipo", tokens=(counts[:6], counts[6:]))
    torch.testing.assert_close(losses.mean(), expected, **TOL)
    logged = trl._metrics["train"]
    assert chosen_rewards.mean().item() == pytest.approx(logged["rewards/chosen"][0], abs=1e-5)
    assert rejected_rewards.mean().item() == pytest.approx(logged["rewards/rejected"][0], abs=1e-5)
    assert (chosen_rewards > rejected_rewards).float().mean().item() == pytest.approx(logged["rewards/accuracies"][0])


def test_label_smoothed_dpo_is_trls_conservative_sigmoid():
    """TRL 1.x's DPOTrainer no longer smooths its sigmoid loss (label_smoothing only feeds robust/EXO); the
    conservative DPO form Axolotl's dpo_label_smoothing asks for is TRL's CPO sigmoid on the log-ratios."""
    from trl.experimental.cpo import CPOTrainer

    g = torch.Generator().manual_seed(3)
    chosen, rejected, ref_c, ref_r = (-torch.rand(16, generator=g) * 30 for _ in range(4))
    beta, eps = 0.2, 0.15
    trl = trl_object(CPOTrainer, loss_type="sigmoid", beta=beta, label_smoothing=eps, alpha=0.0)
    expected, _, _ = trl.cpo_loss(chosen - ref_c, rejected - ref_r)
    losses, _, _ = dpo_loss(chosen, rejected, ref_c, ref_r, beta, label_smoothing=eps)
    torch.testing.assert_close(losses, expected, **TOL)
    plain, _, _ = dpo_loss(chosen, rejected, ref_c, ref_r, beta)
    assert not torch.allclose(plain, losses)  # smoothing really changes the loss


def test_orpo_odds_ratio_matches_trl():
    from trl.experimental.orpo import ORPOTrainer

    g = torch.Generator().manual_seed(4)
    chosen, rejected = -torch.rand(32, generator=g) * 3 - 1e-3, -torch.rand(32, generator=g) * 3 - 1e-3
    trl = trl_object(ORPOTrainer, beta=0.1)
    expected = trl.odds_ratio_loss(chosen, rejected)
    ours = odds_ratio_loss(chosen, rejected, 0.1)
    torch.testing.assert_close(ours[0], expected[0], **TOL)  # beta * log sigmoid(log odds)
    torch.testing.assert_close(ours[1].mean(), expected[4], **TOL)  # log odds
    torch.testing.assert_close(ours[2], expected[1], **TOL)  # rewards


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_simpo_matches_trl_cpo_simpo(eps):
    from trl.experimental.cpo import CPOTrainer

    g = torch.Generator().manual_seed(5)
    chosen, rejected = -torch.rand(32, generator=g) * 3, -torch.rand(32, generator=g) * 3
    trl = trl_object(CPOTrainer, loss_type="simpo", beta=2.0, simpo_gamma=0.7, label_smoothing=eps, alpha=0.0)
    expected, expected_chosen, _ = trl.cpo_loss(chosen, rejected)
    losses, chosen_rewards, _ = simpo_loss(chosen, rejected, 2.0, 0.7, eps)
    torch.testing.assert_close(losses, expected, **TOL)
    torch.testing.assert_close(chosen_rewards, expected_chosen, **TOL)


def test_kto_matches_trl_on_random_log_probs():
    from trl import KTOTrainer

    sequences = random_sequences(7, seed=6)
    kl_sequences = random_sequences(7, seed=7)
    labels = torch.tensor([True, False, True, True, False, True, False])
    per_token, sums, _ = random_per_token(sequences, seed=8)
    kl_per_token, kl_sums, _ = random_per_token(kl_sequences, seed=9)
    g = torch.Generator().manual_seed(10)
    ref, ref_kl = sums + torch.randn(7, generator=g), kl_sums - torch.rand(7, generator=g) * 3  # KL > 0
    model = LogProbsModel(kl_per_token, per_token)  # TRL runs the KL forward first
    trl = trl_object(KTOTrainer, model, calculate_KL=True, loss_type="kto", beta=0.25, desirable_weight=1.3,
                     undesirable_weight=0.7)
    kl_batch = trl_padded(kl_sequences)
    inputs = {**trl_padded(sequences), "KL_input_ids": kl_batch["input_ids"], "KL_attention_mask": kl_batch["attention_mask"],
              "KL_completion_mask": kl_batch["completion_mask"], "label": labels, "ref_logps": ref, "ref_KL_logps": ref_kl}
    expected = trl._compute_loss(model, inputs, return_outputs=False)

    kl = max((kl_sums - ref_kl).mean().item(), 0.0)
    assert kl > 0 and trl._metrics["train"]["kl"][0] == pytest.approx(kl, abs=1e-5)
    losses, rewards = kto_loss(sums, ref, labels, kl, 0.25, 1.3, 0.7)
    torch.testing.assert_close(losses.mean(), expected, **TOL)
    assert rewards[labels].mean().item() == pytest.approx(trl._metrics["train"]["rewards/chosen"][0], abs=1e-5)
    assert rewards[~labels].mean().item() == pytest.approx(trl._metrics["train"]["rewards/rejected"][0], abs=1e-5)


# ---- real logits of a tiny model, through the objectives (batching, per-sequence sums, packing) ----------


@pytest.fixture(scope="module")
def model(tiny_llama):
    m = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="sdpa")
    return m.eval()


def ours(objective, model, rows):
    batch = objective.collate(rows)
    totals = dict(zip(objective.stat_names, objective.step_stats(model, batch)))
    loss, values = objective.loss(model, batch, totals)
    return loss, objective.report(dict(zip(objective.metric_names, values.tolist())), totals)


def layouts(pairs):
    return {"unpacked": (False, [[p] for p in pairs]), "packed": (True, [pairs[:3], pairs[3:]])}


@pytest.mark.parametrize("loss_type,weighting", [("sigmoid", False), ("ipo", False), ("sigmoid", True), ("ipo", True)])
@pytest.mark.parametrize("layout", ["unpacked", "packed"])
def test_dpo_objective_matches_trl_on_a_real_model(model, loss_type, weighting, layout):
    """DPO and IPO, and with dpo_use_weighting (TRL's use_weighting, WPO's weights from log sum_v p_v^2)."""
    from trl import DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    pairs = random_pairs(5, seed=11, with_ref=True)
    packed, rows = layouts(pairs)[layout]
    objective = DPO(Collator(0, "sdpa"), packed, beta=0.1, ipo=loss_type == "ipo", weighting=weighting)
    loss, report = ours(objective, model, rows)
    if weighting:  # the weights are not all 1: the oracle below could tell the two apart
        unweighted, _ = ours(DPO(Collator(0, "sdpa"), packed, beta=0.1, ipo=loss_type == "ipo"), model, rows)
        assert abs(loss.item() - unweighted.item()) > 1e-3 * abs(unweighted.item())

    import copy

    fused = copy.deepcopy(model)
    add_fused_lm_head(fused, outputs=("log_probs", "entropy", "mean_logits", "is_top1")
                      + (("log_sum_sq_probs",) if weighting else ()))
    trl = trl_object(DPOTrainer, fused, loss_types=[loss_type], loss_weights=[1.0], beta=0.1, label_smoothing=0.0,
                     ld_alpha=None, f_divergence_type="reverse_kl", use_weighting=weighting)
    sequences = [(p["chosen_input_ids"], p["chosen_labels"]) for p in pairs] + \
                [(p["rejected_input_ids"], p["rejected_labels"]) for p in pairs]
    ref = torch.tensor([p["ref"] for p in pairs])
    with torch.no_grad():
        expected = trl._compute_loss(fused, {**trl_padded(sequences), "ref_chosen_logps": ref[:, 0],
                                             "ref_rejected_logps": ref[:, 1]}, return_outputs=False)
    torch.testing.assert_close(loss.detach(), expected, **TOL)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected"):
        assert report[name] == pytest.approx(trl._metrics["eval"][name][0], abs=1e-5), name  # eval mode


def orpo_cpo_batch(pairs, pad=0):
    """TRL's ORPO/CPO batch: chosen_/rejected_ input_ids, attention_mask and labels (prompt -100)."""
    batch = {}
    for side in ("chosen", "rejected"):
        width = max(len(p[f"{side}_input_ids"]) for p in pairs)
        ids = torch.full((len(pairs), width), pad)
        att = torch.zeros((len(pairs), width), dtype=torch.long)
        lab = torch.full((len(pairs), width), IGNORE)
        for i, p in enumerate(pairs):
            n = len(p[f"{side}_input_ids"])
            ids[i, :n], att[i, :n], lab[i, :n] = torch.tensor(p[f"{side}_input_ids"]), 1, torch.tensor(p[f"{side}_labels"])
        batch.update({f"{side}_input_ids": ids, f"{side}_attention_mask": att, f"{side}_labels": lab})
    return batch


@pytest.mark.parametrize("layout", ["unpacked", "packed"])
@pytest.mark.parametrize("nll_on_prompt", [False, True])
def test_orpo_objective_matches_trl_on_a_real_model(model, layout, nll_on_prompt):
    from trl.experimental.orpo import ORPOTrainer

    pairs = random_pairs(5, seed=12)
    packed, rows = layouts(pairs)[layout]
    loss, report = ours(ORPO(Collator(0, "sdpa"), packed, beta=0.2, nll_on_prompt=nll_on_prompt), model, rows)
    trl = trl_object(ORPOTrainer, model, beta=0.2, padding_value=0, label_pad_token_id=IGNORE)
    with torch.no_grad():
        expected, metrics = trl.get_batch_loss_metrics(model, orpo_cpo_batch(pairs))
    if nll_on_prompt:  # TRL's ORPO NLL covers prompt and answer: train_on_inputs: true
        torch.testing.assert_close(loss.detach(), expected, **TOL)
        assert report["nll_loss"] == pytest.approx(metrics["nll_loss"], abs=1e-5)
    else:  # the odds-ratio term is TRL's; the NLL is over the answer tokens only
        assert report["log_odds_ratio"] == pytest.approx(metrics["log_odds_ratio"], abs=1e-5)
        assert report["nll_loss"] != pytest.approx(metrics["nll_loss"], abs=1e-3)  # the prompt really is left out
        assert loss.item() == pytest.approx(report["nll_loss"] - 0.2 * report["log_odds_ratio"], abs=1e-5)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected",
                 "log_odds_chosen"):
        assert report[name] == pytest.approx(metrics[name], abs=1e-5), name


@pytest.mark.parametrize("layout", ["unpacked", "packed"])
def test_simpo_objective_matches_trl_cpo_on_a_real_model(model, layout):
    from trl.experimental.cpo import CPOTrainer

    pairs = random_pairs(5, seed=13)
    packed, rows = layouts(pairs)[layout]
    loss, report = ours(SimPO(Collator(0, "sdpa"), packed, beta=2.0, gamma=0.5, cpo_alpha=0.7), model, rows)
    trl = trl_object(CPOTrainer, model, loss_type="simpo", beta=2.0, simpo_gamma=0.5, cpo_alpha=0.7, label_smoothing=0.0,
                     alpha=0.0, pad_token_id=0, label_pad_token_id=IGNORE)
    with torch.no_grad():
        expected, metrics = trl.get_batch_loss_metrics(model, orpo_cpo_batch(pairs))
    torch.testing.assert_close(loss.detach(), expected, **TOL)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "nll_loss"):
        assert report[name] == pytest.approx(metrics[name], abs=1e-5), name


@pytest.mark.parametrize("layout", ["unpacked", "packed"])
def test_kto_objective_matches_trl_on_a_real_model(model, layout):
    import copy

    from trl import KTOTrainer
    from trl.trainer.utils import add_fused_lm_head

    seqs, kl_seqs = random_sequences(6, seed=14), random_sequences(6, seed=15)
    labels = [True, False, True, False, True, True]
    g = torch.Generator().manual_seed(16)
    ref = (-torch.rand(6, 2, generator=g) * 20).tolist()
    examples = [{"input_ids": s[0], "labels": s[1], "kl_input_ids": k[0], "kl_labels": k[1], "label": lab, "ref": r}
                for s, k, lab, r in zip(seqs, kl_seqs, labels, ref)]
    packed = layout == "packed"
    rows = [examples[:3], examples[3:]] if packed else [[e] for e in examples]
    loss, report = ours(KTO(Collator(0, "sdpa"), packed, beta=0.1, desirable_weight=1.0, undesirable_weight=1.5), model, rows)

    fused = copy.deepcopy(model)
    add_fused_lm_head(fused, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    trl = trl_object(KTOTrainer, fused, calculate_KL=True, loss_type="kto", beta=0.1, desirable_weight=1.0,
                     undesirable_weight=1.5)
    batch, kl = trl_padded(seqs), trl_padded(kl_seqs)
    ref = torch.tensor(ref)
    inputs = {**batch, "KL_input_ids": kl["input_ids"], "KL_attention_mask": kl["attention_mask"],
              "KL_completion_mask": kl["completion_mask"], "label": torch.tensor(labels), "ref_logps": ref[:, 0],
              "ref_KL_logps": ref[:, 1]}
    with torch.no_grad():
        expected = trl._compute_loss(fused, inputs, return_outputs=False)
    torch.testing.assert_close(loss.detach(), expected, **TOL)
    logged = trl._metrics["eval"]  # the model is in eval mode
    assert report["kl"] == pytest.approx(logged["kl"][0], abs=1e-5)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert report[name] == pytest.approx(logged[name][0], abs=1e-5), name


def test_first_dpo_step_loss_is_log_2_when_the_policy_is_the_reference(model):
    pairs = random_pairs(4, seed=17)
    objective = DPO(Collator(0, "sdpa"), packed=True, beta=0.1)
    ref = objective.reference(model, objective.collate([pairs]))
    for pair, r in zip(pairs, ref.tolist()):
        pair["ref"] = r
    loss, report = ours(objective, model, [[p] for p in pairs])
    assert loss.item() == pytest.approx(math.log(2), abs=1e-5)
    assert report["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
