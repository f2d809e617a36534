"""rl: ebft (strided mode): the reward math and RLOO against straightforward loops, the strided attention layout
against separate per-rollout forwards, and real training of the tiny model (LoRA and full fine-tune) with exact
resume, through Axolotl-style transforms named module.function."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.trainer.helpers import WORDS, read_metrics, run_cli, train_then_resume, write_jsonl
from trainer.cli import main
from trainer.objectives import ebft_strided

# --- rewards, whitening, advantages ----------------------------------------------------------------------------


def reference_rewards(gen: np.ndarray, gt: np.ndarray, whitening: bool, a_coef: float, d_coef: float):
    """Loops over documents and blocks, float64. Whitening from the eigendecomposition of the rollouts' (uncentred)
    second-moment matrix phi^T phi = U S^2 U^T: W = U S^-1 U^T on the directions above tol (the paper's whitening;
    Axolotl's rewards.py whiten_embeddings_batched gets the same W from an SVD of phi^T). Then (paper eq 7,
    Axolotl's strided.py _compute_block_rewards) alignment 2 cos(g_j, gt), diversity 2/(n-1) sum_{j' != j} g_j.g_j',
    cfm ||mean_j g_j - gt||^2."""
    B, N, K, D = gen.shape
    reward, align, div, cfm = *(np.zeros((B, N, K)) for _ in range(3)), np.zeros((B, K))
    for b in range(B):
        for k in range(K):
            g, t = gen[b, :, k].astype(np.float64), gt[b, k].astype(np.float64)
            if whitening:
                vals, vecs = np.linalg.eigh(g.T @ g)
                s = np.sqrt(np.clip(vals, 0, None))
                keep = s > 1e-5 * s.max()
                w = (vecs[:, keep] / s[keep]) @ vecs[:, keep].T
                g, t = g @ w, t @ w
            for j in range(N):
                align[b, j, k] = 2 * g[j] @ t / (np.linalg.norm(g[j]) * np.linalg.norm(t))
                others = [g[j] @ g[o] for o in range(N) if o != j]
                div[b, j, k] = 2 * sum(others) / (N - 1) if N > 1 else 0.0
                reward[b, j, k] = a_coef * align[b, j, k] - d_coef * div[b, j, k]
            cfm[b, k] = ((g.mean(0) - t) ** 2).sum()
    return reward, align, div, cfm


@pytest.mark.parametrize("whitening", [False, True])
@pytest.mark.parametrize("n", [1, 3, 4])
def test_rewards_match_loops(whitening, n):
    torch.manual_seed(n)
    gen, gt = torch.randn(2, n, 3, 16, dtype=torch.float64), torch.randn(2, 3, 16, dtype=torch.float64)
    e = ebft_strided.EbftConfig(mode="strided", use_whitening=whitening, alignment_coef=0.7, diversity_coef=1.3,
                        n_samples_per_prompt=n)
    got = ebft_strided.block_rewards(gen, gt, e)
    want = reference_rewards(gen.numpy(), gt.numpy(), whitening, 0.7, 1.3)
    for key, value in zip(("reward", "alignment", "diversity", "cfm"), want):
        # whitening runs in float32, as Axolotl's whiten_embeddings_batched
        np.testing.assert_allclose(got[key].numpy(), value, rtol=1e-5 if whitening else 1e-9, atol=1e-5 if whitening else 1e-12, err_msg=key)
    if whitening and n > 1:  # whitened over its own n rollouts (n <= D), each block's rollouts are orthonormal
        assert got["diversity"].abs().max() < 1e-5


def test_whitening_drops_directions_below_tolerance():
    """Rank-deficient rollouts (two identical): the null direction gets weight 0 instead of 1/0."""
    g = torch.randn(1, 3, 8, dtype=torch.float64)
    g[0, 2] = g[0, 1]
    w, _ = ebft_strided.whiten(g, g)
    assert torch.isfinite(w).all()
    np.testing.assert_allclose(w[0, 1].numpy(), w[0, 2].numpy(), atol=1e-10)


def test_advantages_match_loops():
    r = torch.randn(2, 4, 3, dtype=torch.float64)
    rloo = ebft_strided.advantages(r, "rloo")
    norm = ebft_strided.advantages(r, "group_norm")
    for b in range(2):
        for k in range(3):
            col = r[b, :, k].tolist()
            mean, std = sum(col) / 4, math.sqrt(sum((x - sum(col) / 4) ** 2 for x in col) / 3)
            for j in range(4):
                assert rloo[b, j, k] == pytest.approx(col[j] - (sum(col) - col[j]) / 3)
                assert norm[b, j, k] == pytest.approx((col[j] - mean) / (std + 1e-8))
    assert torch.equal(ebft_strided.advantages(r, "reinforce"), r)
    assert torch.allclose(rloo.sum(1), torch.zeros(2, 3, dtype=torch.float64), atol=1e-12)  # a baseline, no bias
    e = ebft_strided.EbftConfig(mode="strided", n_samples_per_prompt=1)
    assert e.estimator == "reinforce"  # Axolotl's fallback with one rollout


def test_top_p_keeps_the_token_that_crosses_it():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    torch.manual_seed(0)
    draws = torch.stack([ebft_strided.sample(logits, 1.0, 0.6) for _ in range(400)]).flatten()
    assert set(draws.tolist()) == {0, 1}  # 0.5 < 0.6: the second token is kept, the rest dropped
    assert ebft_strided.sample(logits, 0.0, 1.0).item() == 0  # temperature 0: greedy


# --- the strided layout ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    from trainer.model.tiny import build_model, build_tokenizer

    return build_model(build_tokenizer(), seed=3).eval()


def test_strided_layout_is_each_rollout_on_its_own_prefix(tiny):
    """One forward over the strided layout gives every generated token the logits and hidden states of a plain
    causal forward over its document prefix [0, a_b) and its block's earlier tokens, and the document its own."""
    from trainer.objectives.ebft import sdpa

    S, anchor, stride, G = 22, 5, 4, 3
    K = ebft_strided.num_blocks(S, G, anchor, stride)
    assert K == 4
    torch.manual_seed(1)
    doc = torch.randint(5, 300, (S,))
    gen = torch.randint(5, 300, (G, K))  # gen[s, b]: token s of block b
    seq = torch.cat([doc, gen.flatten()])[None]
    mask = ebft_strided.strided_mask(S, anchor, stride, K, G, G)[None, None]
    pos = ebft_strided.strided_positions(S, anchor, stride, K, G)[None]
    with torch.no_grad(), sdpa(tiny):
        out = tiny(input_ids=seq, attention_mask=mask, position_ids=pos, output_hidden_states=True, use_cache=False)
        plain = tiny(input_ids=doc[None], use_cache=False, output_hidden_states=True)
    torch.testing.assert_close(out.logits[0, :S], plain.logits[0], rtol=1e-4, atol=1e-5)
    for b in range(K):
        a = anchor + b * stride
        alone = torch.cat([doc[:a], gen[:, b]])[None]
        with torch.no_grad():
            ref = tiny(input_ids=alone, use_cache=False, output_hidden_states=True)
        for s in range(G):
            at = S + s * K + b
            torch.testing.assert_close(out.logits[0, at], ref.logits[0, a + s], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(out.hidden_states[1][0, at], ref.hidden_states[1][0, a + s], rtol=1e-4, atol=1e-5)
    # the logits that score token s of block b are those that sampled it: before the anchor, then the block's last
    where = ebft_strided.predicting_positions(S, anchor, stride, K, G)
    for s in range(G):
        for b in range(K):
            expect = anchor + b * stride - 1 if s == 0 else S + (s - 1) * K + b
            assert where[s * K + b] == expect


def test_loss_is_reinforce_with_rloo_over_separate_rollouts(tiny):
    """The objective's loss on a batch equals the method computed the slow way: each rollout run alone on its
    document prefix (its tokens' log-probs, its features), the ground-truth block alone, rewards and RLOO by the
    loops above, loss = -sum(A * log pi) / tokens. Same RNG seed, so the same rollouts are sampled."""
    from types import SimpleNamespace

    from trainer.objectives.ebft import EBFT, sdpa

    e = ebft_strided.EbftConfig(mode="strided", stride=3, context_length=4, generate_max_len=3, n_samples_per_prompt=3,
                        temperature=1.0, feature_layers=[0.5, 1.0], use_whitening=True, ce_coef=0.1)
    objective = EBFT(SimpleNamespace(ebft=e), pad_token_id=0)
    objective.before_training(tiny)  # full fine-tune: a frozen copy is the feature network
    torch.manual_seed(7)
    docs = [torch.randint(5, 300, (16,)).tolist() for _ in range(2)]
    batch = objective.collate([[{"input_ids": d, "labels": d}] for d in docs])
    totals = dict(zip(objective.stat_names, objective.step_stats(tiny, batch)))
    torch.manual_seed(11)
    loss, _ = objective.loss(tiny, batch, totals)
    torch.manual_seed(11)
    with sdpa(tiny):
        seqs = objective.generate(tiny, batch["input_ids"].repeat_interleave(3, dim=0), batch["anchor"], batch["blocks"])
    S, K, G, n = 16, batch["blocks"], 3, 3
    assert K == 4 and totals["action_tokens"] == 2 * n * K * G

    def last(ids, layers=(1, 2)):
        with torch.no_grad():
            out = tiny(input_ids=torch.tensor(ids)[None], output_hidden_states=True, use_cache=False)
        feats = torch.cat([F.normalize(out.hidden_states[i][0, -1], dim=-1) for i in layers])
        return feats.double().numpy(), torch.log_softmax(out.logits[0, -1].double(), -1)

    gen, gt = np.zeros((2, n, K, 128)), np.zeros((2, K, 128))
    logps = np.zeros((2, n, K, G))
    for d in range(2):
        for b in range(K):
            a = 4 + 3 * b
            gt[d, b] = last(docs[d][:a + G])[0]
            for j in range(n):
                rollout = [int(seqs[d * n + j, S + s * K + b]) for s in range(G)]
                for s in range(G):
                    logps[d, j, b, s] = float(last(docs[d][:a] + rollout[:s])[1][rollout[s]])
                gen[d, j, b] = last(docs[d][:a] + rollout)[0]
    reward = reference_rewards(gen, gt, True, 1.0, 1.0)[0]
    adv = reward - (reward.sum(1, keepdims=True) - reward) / (n - 1)
    expect = -(adv[..., None] * logps).sum() / (2 * n * K * G)
    with torch.no_grad():  # ce_coef: cross-entropy over every document token (unstructured rows, as Axolotl)
        doc_logits = torch.log_softmax(tiny(input_ids=torch.tensor(docs), use_cache=False).logits.double(), -1)
    ce = -doc_logits[:, :-1].gather(-1, torch.tensor(docs)[:, 1:, None]).mean().item()
    expect += 0.1 * ce
    assert float(loss) == pytest.approx(expect, rel=1e-3, abs=1e-5)


# --- training ----------------------------------------------------------------------------------------------------

PRETRAIN = '''"""A local stand-in for Axolotl's examples/ebft/ebft_pretrain.py: text padded to sequence_len."""


def transform(cfg, *args, **kwargs):
    def row(example, tokenizer=None):
        enc = tokenizer(example["text"], truncation=True, max_length=cfg.sequence_len, padding="max_length")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                "labels": list(enc["input_ids"])}

    return row, {"remove_columns": ["question", "answer"]}
'''

STRIDED = {"mode": "strided", "stride": 8, "context_length": 8, "generate_max_len": 4, "n_samples_per_prompt": 4,
           "temperature": 0.6, "top_p": 1.0, "feature_layers": [0.25, 0.5, 0.75], "embed_method": "last_token",
           "use_whitening": True, "alignment_coef": 1.0, "diversity_coef": 1.0, "rl_coef": 1.0, "ce_coef": 0.0,
           "advantage_estimator": "rloo"}


@pytest.fixture
def ebft_config(make_config, tmp_path):
    rng = random.Random(0)
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": " ".join(rng.choice(WORDS) for _ in range(40))}
                                                 for _ in range(12)])
    (tmp_path / "ebft_pretrain.py").write_text(PRETRAIN)  # next to the config, as in Axolotl's examples/ebft

    def make(name="ebft.yml", ebft_block=None, **extra):
        keys = dict(rl="ebft", ebft={**STRIDED, **(ebft_block or {})},
                    datasets=[{"path": str(text), "type": "ebft_pretrain.transform", "split": "train"}],
                    sequence_len=32, micro_batch_size=1, gradient_accumulation_steps=2, max_steps=4, save_steps=2,
                    learning_rate=1e-3, val_set_size=0.0, ddp=False)
        keys.update(extra)
        return make_config(name, **keys)

    return make


def ebft_rows(output_dir):
    return [r for r in read_metrics(output_dir) if "ebft/cfm_loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["lora", None])
def test_trains_and_resumes_exactly(ebft_config, tmp_path, adapter):
    lora = dict(adapter="lora", lora_r=4, lora_alpha=8, lora_dropout=0.05, lora_target_linear=True) if adapter else {}
    if adapter:  # as Axolotl's llama-3b example: reentrant gradient checkpointing over the strided forward
        lora.update(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})
    full, _ = train_then_resume(main, lambda name, **kw: ebft_config(name, **kw, **lora), tmp_path)
    rows = ebft_rows(full)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["ebft/num_blocks"] == 3  # (32 - 4 - 8) // 8 + 1 anchors per document
        assert -2.0 <= r["ebft/alignment"] <= 2.0 and math.isfinite(r["ebft/cfm_loss"]) and r["ebft/cfm_loss"] > 0
        assert r["ebft/advantages_std"] > 0 and r["loss"] == pytest.approx(r["ebft/rl_loss"])
        assert abs(r["ebft/diversity"]) < 1e-4  # whitened over its own 4 rollouts: orthonormal (see above)
    # the policy moved: the first step's rewards came from the initial model, later ones differ in loss
    assert len({round(r["ebft/rl_loss"], 9) for r in rows}) == 4


def test_structured_rows_anchor_after_the_prompt_and_train_ce(ebft_config, tmp_path):
    """ebft_strided_structured.transform (built in, as in Axolotl): anchors start min_completion_prefix tokens
    after the longest prompt of the micro-batch, and ce_coef adds the completion's cross-entropy."""
    rows = [{"input": "Repeat " + " ".join(random.Random(i).choice(WORDS) for _ in range(3)),
             "output": " ".join(random.Random(100 + i).choice(WORDS) for _ in range(30))} for i in range(8)]
    data = write_jsonl(tmp_path / "qa.jsonl", rows)
    config = ebft_config("s.yml", ebft_block={"ce_coef": 0.03, "min_completion_prefix": 2, "use_whitening": False},
                         datasets=[{"path": str(data), "type": "ebft_strided_structured.transform"}],
                         sequence_len=40, max_steps=2, save_steps=None, micro_batch_size=2, gradient_accumulation_steps=1)
    assert main(["train", str(config)]) == 0
    from trainer.config import load_config
    from trainer.data.prepare import load_tokenizer

    cfg, _ = load_config(config)
    tok = load_tokenizer(cfg)
    prompts = [len(tok(r["input"])["input_ids"]) for r in rows]
    possible = {ebft_strided.num_blocks(40, 4, max(max(a, b) + 2, 8), 8) for a in prompts for b in prompts}
    for r in ebft_rows(tmp_path / "out"):
        assert r["ebft/num_blocks"] in possible and r["ebft/ce_loss"] > 0
        assert r["loss"] == pytest.approx(r["ebft/rl_loss"] + 0.03 * r["ebft/ce_loss"])


@pytest.mark.slow
@pytest.mark.parametrize("block,message", [
    ({"feature_layers": [0.5, 2.0]}, "ebft.feature_layers"),
    ({"embed_method": "nonsense"}, "ebft.embed_method"),
    ({"embed_method": "concat"}, "ebft.embed_method: concat"),
    ({"context_length": 30}, "leaves no anchor"),
])
def test_bad_ebft_configs_are_one_line_errors(ebft_config, block, message):
    result = run_cli("validate", str(ebft_config(ebft_block=block)), "--gpu", "cpu")
    assert result.returncode == 2, result.stdout
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_missing_transform_is_one_line(ebft_config, tmp_path):
    config = ebft_config(datasets=[{"path": str(tmp_path / "text.jsonl"), "type": "no_such_module.transform"}])
    result = run_cli("train", str(config))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(errors) == 1 and "no module no_such_module.py" in errors[0]
