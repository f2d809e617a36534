"""Stop requests: SIGTERM, SIGUSR1 and Ctrl-C (SIGINT) ask a run to stop at the next step boundary with a checkpoint.

What schedulers send before they take the machine away: Slurm's `--signal=USR1@secs` and its preemption and
time-limit SIGTERM, Kubernetes' SIGTERM before terminationGracePeriodSeconds, a spot reclaim's SIGTERM. The handler
only records the request (a flag; no I/O but one os.write of a notice); the loop carries it in the all-reduce it
already makes for each step's totals (trainer/train.py), so every rank learns of it at the same step whichever rank
was signalled, finishes that step, writes one checkpoint and exits with

    REQUEUE_EXIT (138) after SIGTERM or SIGUSR1: 128 + SIGUSR1, the exit code the Kubeflow training operator's
        `restartPolicy: ExitCode` reserves for "retryable, chosen by the program" (pkg/util/train/train_util.go:
        130, 137 and 143 are the signal deaths it also retries; 1, 2, 126, 127, 128 and 139 are permanent). No
        crash exits 138, so a script (the sbatch script `--emit slurm` writes) can requeue on it alone;
    INTERRUPT_EXIT (130) after Ctrl-C, the shell's code for SIGINT.

A second SIGINT stops at once (KeyboardInterrupt, no checkpoint). Repeated SIGTERMs are one request: Slurm signals
every process of a job step and torchrun forwards the signal again, so a rank may see it twice.

The handler stays installed until the final model's last byte is written. A request that arrives during the final
evaluation or save (`finishing()`; the emitted sbatch sends SIGUSR1 five minutes before the time limit) does not
interrupt them: they finish, the run is complete and exits 0. (trainer/train.py writes output_dir/stopped.json
when they begin, naming the newest checkpoint, so that if the scheduler kills the process before the save ends
the same command resumes and completes the run; the finished save removes it again.)

ENVTOOL_PAUSE_AT=POINT (`pause_at`, trainer/runtime/signals.py): the run prints one line and waits, at that point
of the real code path, until a stop signal arrives (at most 10 minutes), then goes on. Points: `final-eval` (before
the final evaluation) and `final-save` (the final model written to its temporary directory, not yet renamed).
"""

from __future__ import annotations

import os
import signal
import threading

REQUEUE_EXIT = 138
INTERRUPT_EXIT = 130
SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")


class StopRequest:
    """Catches the stop signals while installed; `signal` is the first one received (None: no request)."""

    def __init__(self, say_rank0: bool = True):
        self.signal: int | None = None
        self.interrupts = 0
        self.say = say_rank0
        self.previous: dict[int, object] = {}
        self.in_final = False  # set when the final evaluation and save begin

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else ""

    @property
    def exit_code(self) -> int:
        return INTERRUPT_EXIT if self.signal == signal.SIGINT else REQUEUE_EXIT

    def install(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():  # (Ray Train workers run the loop in a thread)
            return self
        for name in SIGNALS:
            number = getattr(signal, name)
            self.previous[number] = signal.signal(number, self._handle)
        return self

    def finishing(self) -> None:
        """From now on a request does not stop the run: the final evaluation and save finish first."""
        self.in_final = True

    def pause_at(self, point: str, say=print) -> None:
        """ENVTOOL_PAUSE_AT=point: say so and wait for a stop signal (the real path goes on afterwards)."""
        if self.previous:  # only while the handler is installed (else the signal would end the process)
            # start-up: trainer.runtime.signals imported only when this runs
            from trainer.runtime.signals import pause_at

            pause_at(point, say, until=lambda: self.requested)

    def uninstall(self) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        self.previous = {}

    def _handle(self, number: int, _frame) -> None:
        if number == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:  # pressed twice: now, without a checkpoint
                signal.signal(signal.SIGINT, signal.default_int_handler)
                raise KeyboardInterrupt
        if self.signal is None:
            self.signal = number
            if self.say and self.in_final:
                again = " (Ctrl-C again stops at once, without it)" if number == signal.SIGINT else ""
                os.write(2, f"\n{signal.Signals(number).name}: the final evaluation and save are under way: "
                         f"finishing them first{again}\n".encode())
            elif self.say:
                again = " (Ctrl-C again stops at once, without one)" if number == signal.SIGINT else ""
                os.write(2, f"\n{signal.Signals(number).name}: stopping after this step with a checkpoint{again}\n"
                         .encode())
