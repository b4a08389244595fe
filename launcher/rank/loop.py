"""One training step, evaluation and the step loop (pipeline schedules from megatron.core)."""
from __future__ import annotations

import signal
import time
from functools import partial
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from launcher.rank.batch import masked_token_loss, slice_batch_for_context_parallel

# Stop requests: the Slurm job script turns --signal=B:USR1 into a STOP file in the bundle (torchrun would
# die on USR1); SIGUSR1 sent straight to a rank works too. SIGTERM keeps its default: torchrun uses it to
# tear down ranks when one fails.
STOP_SIGNALS = (signal.SIGUSR1,)


def forward_step(data_iterator, model):
    """Megatron forward_step_func: this CP rank's slice of the batch through GPTModel, per-token losses
    reduced by ``masked_token_loss`` (a mean over the whole sequence's tokens, across the CP group)."""
    batch = next(data_iterator)
    dev = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    batch = slice_batch_for_context_parallel({k: v.to(dev, non_blocking=True) for k, v in batch.items()})
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(masked_token_loss, batch["loss_mask"])


def schedule_func(kind: str) -> Callable:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if kind not in ("1f1b", "interleaved"):
        raise NotImplementedError(f"schedule.kind={kind!r} is not available on the rank side; "
                                  "use 1f1b or interleaved")
    return get_forward_backward_func()  # picks interleaved when virtual_pipeline > 1


def _mean_lm_loss(losses: List[Dict[str, torch.Tensor]]) -> float:
    return float(torch.stack([x["lm loss"].float() for x in losses]).mean()) if losses else 0.0


def reduce_report(local_loss: float, stop: bool) -> tuple:
    """World all-reduce: mean loss over the ranks that hold it (last stage, TP rank 0), and whether any
    rank asked to stop. One small collective per step."""
    from megatron.core import parallel_state

    holder = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
    dev = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    t = torch.tensor([local_loss if holder else 0.0, float(holder), float(stop)], dtype=torch.float64,
                     device=dev)
    torch.distributed.all_reduce(t)
    return float(t[0] / t[1].clamp(min=1)), bool(t[2] > 0)


class Loop:
    """Step loop state: what a checkpoint restores (step, consumed samples) and the stop flag."""

    def __init__(self, *, model, optimizer, scheduler, train, seq_length: int, num_microbatches: int,
                 kind: str, dp_size: int):
        self.model, self.optimizer, self.scheduler, self.train = model, optimizer, scheduler, train
        self.seq_length, self.num_microbatches, self.dp_size = seq_length, num_microbatches, dp_size
        self.fwd_bwd = schedule_func(kind)
        self.step, self.consumed = 0, 0
        self.stop_requested = False
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._request_stop)

    def _request_stop(self, signum, frame) -> None:
        self.stop_requested = True

    def _iter_arg(self, iterators):
        return iterators if len(self.model) > 1 else iterators[0]

    def train_step(self, iterators) -> dict:
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self.optimizer.param_groups[0]["lr"]
        losses = self.fwd_bwd(forward_step_func=forward_step, data_iterator=self._iter_arg(iterators),
                              model=self.model, num_microbatches=self.num_microbatches,
                              seq_length=self.seq_length, micro_batch_size=self.train.micro_batch_size,
                              forward_only=False)
        _, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        self.step += 1
        self.consumed += self.train.global_batch_size
        return {"local_loss": _mean_lm_loss(losses), "lr": lr,
                "grad_norm": float(grad_norm) if grad_norm is not None else 0.0}

    @torch.no_grad()
    def evaluate(self, iterators) -> float:
        for chunk in self.model:
            chunk.eval()
        losses = []
        for _ in range(max(1, self.train.eval_iters)):
            out = self.fwd_bwd(forward_step_func=forward_step, data_iterator=self._iter_arg(iterators),
                               model=self.model, num_microbatches=self.num_microbatches,
                               seq_length=self.seq_length, micro_batch_size=self.train.micro_batch_size,
                               forward_only=True)
            losses.append(_mean_lm_loss(out))
        for chunk in self.model:
            chunk.train()
        loss, _ = reduce_report(sum(losses) / len(losses), False)
        return loss

    def run(self, *, iterators, valid_iters: Callable, steps: int, on_step: Callable,
            on_eval: Callable, on_checkpoint: Callable, save_interval: int,
            flops_per_token: float, tokens_per_step: int, world: int, deadline: Optional[float],
            stop_file: Optional[Path] = None) -> str:
        """Train to ``steps``; returns why it stopped: 'done' or 'stopped' (STOP file, SIGUSR1 or time
        limit; the caller then checkpoints). Any rank's reason stops all ranks at the same step."""
        from launcher.rank.metrics import memory_gib

        while self.step < steps:
            start = time.perf_counter()
            out = self.train_step(iterators)
            wanted_stop = (self.stop_requested or (deadline is not None and time.time() > deadline)
                           or (stop_file is not None and stop_file.exists()))
            loss, stop = reduce_report(out["local_loss"], wanted_stop)
            elapsed = time.perf_counter() - start
            tflops = flops_per_token * tokens_per_step / elapsed / world / 1e12
            on_step({"step": self.step, "loss": loss, "lr": out["lr"], "grad_norm": out["grad_norm"],
                     "ms_per_step": elapsed * 1e3, "tokens_per_s": tokens_per_step / elapsed,
                     "tflops": tflops,
                     "mem_gib": memory_gib()})
            if self.train.eval_interval and self.step % self.train.eval_interval == 0:
                vi = valid_iters()
                if vi is not None:
                    on_eval(self.step, self.evaluate(vi))
            if stop:
                return "stopped"
            if save_interval and self.step % save_interval == 0:
                on_checkpoint()
        return "done"
