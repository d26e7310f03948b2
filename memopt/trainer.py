"""The one training loop: data -> forward -> backward -> step -> metrics, records and checkpoint.

Strategies never appear here by name: they act through the engine ``engines.build_engine`` returns
(the model's own forward, the precision's autocast and loss scale, the optimizer's step). Data is
sharded over the data-parallel dimension of the mesh (``dims.dp``); run records gather every rank. The same clock and the
same memory tracker wrap every engine, so numbers are comparable by construction.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import statistics
import sys
import time
import traceback
import torch

from memopt import checkpoint, compose, engines, model_file
from memopt.config import TrainConfig
from memopt.data import TokenBatches, load_tokens
from memopt.errors import ConfigError, Diverged, status_of
from memopt.guards import DivergenceGuard, StopSignals
from memopt import outcome
from memopt.logging import RunLogger
from memopt.memory.hardware import (device_runtime_bytes, peak_tflops_for, resolve_hardware, run_peak_tflops,
                                     tensor_budget_bytes)
from memopt.memory import host_malloc
from memopt.memory.tracker import MemoryTracker, NullTracker
from memopt.optim.schedule import lr_at
from memopt.parallel import setup
from memopt.parallel.comm import CommCounter
from memopt.profiling import PHASES, StepProfiler
from memopt.records import new_run_id, run_record
from memopt.watchdog import WATCHED_BY_LAUNCHER


def resolve_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device=cuda but no CUDA device is available; use trainer.device=cpu or auto")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class Trainer:
    def __init__(self, cfg: TrainConfig, run_dir: str, resolved_config: dict | None = None, group: str | None = None):
        self.cfg, self.run_dir = cfg, run_dir
        self._profiler = None  # trainer.profile_step's (profiling.StepProfiler), closed however the run ends
        self._compute_dtype: str | None = None
        self._carried_bad = 0  # the divergence count a resumed run continues (from the checkpoint's meta.json)
        self.device = resolve_device(cfg.trainer.device)
        self.dims = setup(self.device, cfg.parallel)
        self.rank, self.world = self.dims.rank, self.dims.world_size
        self.resolved_config = resolved_config or {}
        self.group = group or cfg.logger.group or cfg.experiment
        self.summary: dict = {}
        self.heartbeat = self.watchdog = None

    # ------------------------------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.cfg
        if self._already_finished():
            return self.summary
        previous = run_record(self._summary_on_disk()) if cfg.trainer.resume else None
        strategies = cfg.strategy.selected()
        tags = sorted(set(strategies) | {cfg.engine.name} | set(cfg.logger.tags))
        run_name = "+".join(strategies or ["plain"]) + f"/{cfg.engine.name}/{cfg.model.name}"
        self.run_id = new_run_id()
        self.summary = {
            "status": "failed", "run_id": self.run_id, "engine": cfg.engine.name, "strategy": strategies,
            "model": cfg.model.name, "params": compose.num_params(cfg),
            "active_params": compose.active_params(cfg), "world_size": self.world, "seed": cfg.seed,
            "parallel": self.dims.summary(),
        }
        self.logger = RunLogger(self.run_dir, cfg, self.resolved_config, run_name, self.group, tags, enabled=self.rank == 0,
                                run_id=self.run_id)
        tracker = NullTracker()
        # DeepSpeed's zero.Init (engine=deepspeed, ZeRO-3) replaces torch.nn.functional.linear process-wide with its
        # ZeRO-3 linear "unless manually reset": every later run of the process (a sweep's, a benchmark's) would
        # train through it; the run puts it back
        linear = torch.nn.functional.linear
        try:
            if cfg.trainer.num_threads > 0:
                torch.set_num_threads(cfg.trainer.num_threads)
            if self.device.type == "cpu":  # every engine alike (a fair side by side); not on a GPU's host
                if cfg.trainer.cpu_malloc_cache:
                    host_malloc.keep_freed_blocks()
                self.summary["cpu_malloc_cache"] = host_malloc.in_effect()  # as the process runs, an earlier run's too
            self.hw = resolve_hardware(cfg.hardware, self.device)  # its CPU matmul probe is not the run's memory
            tracker = MemoryTracker(self.device, budget=self._device_budget(), budget_name=self._budget_name()) \
                if cfg.trainer.track_memory else NullTracker()
            self._start_watchdog()
            with tracker, StopSignals() as self.signals:
                self._train(tracker)
            self._reread_peak()
            self.summary["status"] = "ok"
        except BaseException as exc:  # recorded, then re-raised for the caller to decide
            self.summary["status"] = status_of(exc)
            self.summary["error"] = f"{type(exc).__name__}: {exc}" + self._where()
            self.summary["traceback"] = traceback.format_exc(limit=20)
            raise
        finally:
            torch.nn.functional.linear = linear
            self._stop_watchdog()
            if self._profiler is not None:  # a step that raised left it running: the next job in this process needs it off
                self._profiler.close()
            if previous is not None and self.summary["status"] != "ok" and "steps_done" not in self.summary:
                self.summary["previous"] = previous  # a resume that ran no step: the run's own record stays
            if "peak_bytes" not in self.summary:  # failed before the ranks could exchange peaks
                if tracker.enabled:
                    self.summary["peak_bytes"] = {str(self.rank): tracker.peaks()}
                self.summary["peak_rss_bytes"] = {str(self.rank): peak_rss_bytes()}
            if self.logger.enabled:
                outcome.record(self.run_dir, self.summary)
            elif self.rank != 0 and self.summary["status"] not in ("ok", "failed"):
                outcome.record_rank_stop(self.run_dir, self.rank, self.summary["status"], self.summary.get("error", ""))
            self.logger.finish(self.summary)
        return self.summary

    def _device_budget(self) -> int | None:
        """The device budget every engine's run is held to (bytes per rank): the hardware profile's device
        memory where the device is its own memory (a GPU, or a CPU run given ``hardware.device_memory_gb``,
        the budget the planner and ``+strategy=auto`` chose the composition for); None where the device is
        the host's RAM."""
        if self.hw.device_is_host or not self.hw.device_memory_gb:
            return None
        fault = os.environ.get("MEMOPT_FAULT_BUDGET", "")  # "<rank>:<bytes>": that rank's own budget (tests: one
        if fault.split(":")[0] == str(self.rank):  # rank crossing alone, its peers left waiting in a collective)
            return int(fault.split(":")[1])
        return tensor_budget_bytes(self.hw)  # the libraries' workspaces left out, as in the plan

    def _reread_peak(self) -> None:
        """MFU divided by a CPU's peak read again after the steps, the higher reading kept (``run_peak_tflops``);
        outside the tracker, whose budget and counts the probe's products are not part of."""
        s = self.summary
        if self.rank != 0 or s.get("tflops") is None or self._compute_dtype is None:
            return  # rank 0's summary is the run's; other ranks' probes would only share its cores
        peak = run_peak_tflops(self.hw, self.cfg.hardware, self._compute_dtype, self.device)
        s.update(peak_tflops_per_device=peak, mfu=(s["tflops"] / (peak * self.world)) if peak else None)

    def _budget_name(self) -> str:
        runtime = device_runtime_bytes(self.hw)
        return "hardware.device_memory_gb" + (f" less {runtime} B of cuBLAS workspaces (hardware.device_runtime_mb)"
                                              if runtime else "")

    # ------------------------------------------------------------------------------------------
    def _train(self, tracker) -> None:
        cfg, t, dp = self.cfg, self.cfg.trainer, self.dims.dp
        data = TokenBatches(load_tokens(cfg.data, cfg.seed), cfg.model.seq_len, cfg.data.val_fraction, cfg.seed)
        hw = self.hw
        torch.manual_seed(cfg.seed + self.rank)  # dropout streams; weights are seeded per parameter
        resume = checkpoint.resolve(t.resume, self.run_dir)  # (the path exists only once a job before this one ran)
        if resume is not None:
            meta = checkpoint.read_meta(resume)
            checkpoint.check_compatible(meta, self._identity(), resume)
            self._carried_bad = int(meta.get("divergence_bad", 0))  # consecutive bad steps before the checkpoint
            # (a checkpoint at or past trainer.max_steps never gets here: _already_finished)
        self._beat("build")
        engine = engines.build_engine(cfg, self.device, self.dims, tracker)
        engine.model.train()
        with tracker.category("temp"):  # the loaded copy of the weights lives only while it is applied
            start = self._resume(engine, resume)

        tokens_per_step = t.micro_batch_size * t.grad_accum * dp.size * cfg.model.seq_len
        fpt = compose.flops_per_token(cfg)  # model-phase strategies included (moe: active experts only)
        peak = peak_tflops_for(hw, engine.compute_dtype_name)
        self._compute_dtype = engine.compute_dtype_name  # the peak MFU divides by is read again at the end
        self.summary.update(flops_per_token=fpt, tokens_per_step=tokens_per_step, hardware=hw.name,
                            peak_tflops_per_device=peak)
        eval_set = data.eval_batches(t.eval_batches, t.micro_batch_size) if t.eval_every and len(data.val) > cfg.model.seq_len else []
        cat = tracker.category

        bar = None
        if t.progress_bar and self.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=t.max_steps, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr, mininterval=0.5)
        step_times, optim_times, losses, val_loss = [], [], [], None
        guard = DivergenceGuard(t.divergence_steps, bad=self._carried_bad)
        profiler = self._profiler = StepProfiler(t.profile_step, self.run_dir, self.rank, self.device, t.profile_trace,
                                                 tracked=tracker.enabled)
        profiled = None  # (its index in step_times, its record) once the profiled step has run
        for step in range(start, t.max_steps):
            profiler.start(step)
            self._sync()
            t0 = time.perf_counter()
            lr = lr_at(step, cfg.optim, t.max_steps)
            loss_sum = torch.zeros((), device=self.device)
            counter = CommCounter() if t.count_comm and step == start else contextlib.nullcontext()
            with counter:  # the first step only (a warm-up step, outside the median tokens/s)
                self._beat("forward/backward", step)
                with profiler.phase(PHASES[0]):  # the phases of a profiled step (profiling.py)
                    for micro in range(t.grad_accum):
                        x, y = data.micro_batch(step, micro, dp.rank, dp.size, t.micro_batch_size, t.grad_accum)
                        with cat("other"):
                            x, y = x.to(self.device), y.to(self.device)
                        loss_sum += engine.forward_backward(x, y, micro, t.grad_accum).float()
                    self._sync()
                t1 = time.perf_counter()
                self._beat("optimizer step", step)
                with profiler.phase(PHASES[1]), cat("temp"):
                    result = engine.step(lr)
                    self._sync()
            if isinstance(counter, CommCounter):
                self.summary["comm_per_step"] = counter.summary()  # this rank's (rank 0's in summary.json)
            optim_times.append(time.perf_counter() - t1)  # the optimizer step alone (after the backward)
            self._beat("loss all-reduce", step)
            dp.all_reduce_(loss_sum)  # global-batch mean: every data-parallel rank's micro-batches weigh the same
            self._sync()
            dt = time.perf_counter() - t0
            step_times.append(dt)
            done = profiler.stop(step)
            if done is not None:  # the profiler slowed this step: out of the medians below
                profiled = (len(step_times) - 1, {"step": step, **{k: done[k] for k in ("files", "phases", "error") if k in done}})
            loss_val = loss_sum.item() / (t.grad_accum * dp.size)
            losses.append(loss_val)

            is_last = step == t.max_steps - 1
            evaluated = bool(eval_set) and ((step + 1) % t.eval_every == 0 or is_last)
            if evaluated:
                self._beat("evaluation", step)
                with cat("temp"):
                    val_loss = sum(engine.eval_loss(x.to(self.device), y.to(self.device)) for x, y in eval_set) / len(eval_set)
            if step % t.log_every == 0 or is_last or evaluated:
                rec = {"step": step, "loss": loss_val, "lr": lr, "step_time_s": dt, "optim_step_s": optim_times[-1],
                       "tokens_per_s": tokens_per_step / dt,
                       "grad_norm": result.grad_norm, "loss_scale": result.loss_scale, "skipped_steps": engine.skipped_steps}
                if evaluated:
                    rec["val_loss"] = val_loss
                if profiled is not None and profiled[0] == len(step_times) - 1:
                    rec["profiled"] = True  # under torch.profiler: slower, out of the medians
                step_metrics = getattr(engine, "step_metrics", None)
                if step_metrics is not None:  # engine-specific placement (the chunk engine's chunks on device, ...)
                    rec[getattr(engine, "metrics_key", "chunk")] = step_metrics()  # (pipeline: its stages' busy time)
                rec.update(engine.model.step_metrics())  # statistics of the model's parts (MoE routing: "moe"), nested
                if tracker.enabled:
                    rec["peak_bytes"] = {d: v["total"] for d, v in tracker.peaks().items()}
                    rec["live_bytes"] = {d: tracker.live_bytes(d) for d in tracker.live}
                self.logger.log(rec)
            if bar is not None:
                bar.set_postfix(loss=f"{loss_val:.4f}", tok_s=f"{tokens_per_step / dt:,.0f}")
                bar.update(1)
            with cat("temp"):  # a checkpoint save's full copy of the weights is a temporary
                self._after_step(step, loss_val, result, engine, guard)
        if bar is not None:
            bar.close()

        skip = profiled[0] if profiled is not None else None  # the profiled step: out of the medians, the warm-up kept

        def timed(times: list[float]) -> list[float]:
            return [x for i, x in enumerate(times) if i >= t.throughput_warmup_steps and i != skip] or \
                [x for i, x in enumerate(times) if i != skip] or times
        warm = timed(step_times)
        med = statistics.median(warm)
        tok_s = tokens_per_step / med
        tflops = tok_s * fpt / 1e12
        self.summary.update(
            final_loss=losses[-1], val_loss=val_loss, tokens_per_s=tok_s, step_time_s=med, tflops=tflops,
            optim_step_s=statistics.median(timed(optim_times)),
            mfu=(tflops / (peak * self.world)) if peak else None, steps=t.max_steps - start,
            skipped_steps=engine.skipped_steps, loss_scale=engine.loss_scale,
            **({"profile": profiled[1]} if profiled is not None else {}),
        )
        if t.save_checkpoint:
            self._beat("final weights (model.pt)")
            self.save_checkpoint(engine)
        # every rank's peaks reach rank 0's summary
        self._beat("final records")
        mine = {"peaks": tracker.peaks() if tracker.enabled else None, "rss": peak_rss_bytes()}
        if self.device.type == "cuda":
            mine["cuda"] = torch.cuda.max_memory_allocated(self.device)
            mine["cuda_reserved"] = torch.cuda.max_memory_reserved(self.device)
        everyone = self.dims.world.gather_objects(mine)
        if tracker.enabled:
            self.summary["peak_bytes"] = {str(r): o["peaks"] for r, o in enumerate(everyone)}
        self.summary["peak_rss_bytes"] = {str(r): o["rss"] for r, o in enumerate(everyone)}
        if self.device.type == "cuda":
            self.summary["cuda_allocator_peak"] = {str(r): o.get("cuda") for r, o in enumerate(everyone)}
            self.summary["cuda_allocator_reserved_peak"] = {str(r): o.get("cuda_reserved") for r, o in enumerate(everyone)}

    # ---- resumable checkpoints, divergence and signals (memopt.checkpoint, memopt.guards) ---------
    def _identity(self) -> dict:
        """What a resumed run must share with the run that wrote the checkpoint."""
        cfg = self.cfg
        from omegaconf import OmegaConf

        options = {n: OmegaConf.to_container(OmegaConf.structured(getattr(cfg.strategy, n))) for n in cfg.strategy.selected()}
        return {"world_size": self.world, "engine": engines.resolve(cfg), "strategy": cfg.strategy.selected(),
                "strategy_options": options, "model": cfg.model.name, "parallel": self.dims.summary(),
                **compose.model_record(cfg)}  # the architecture (model config, moe options) too

    def _summary_on_disk(self) -> dict | None:
        """The run directory's summary.json as it is (rank 0; None when there is none or it is unreadable)."""
        if self.rank != 0:
            return None
        try:
            with open(os.path.join(self.run_dir, "summary.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def _already_finished(self) -> bool:
        """True for a resume from a checkpoint of this configuration at or past ``trainer.max_steps``
        (decided on every rank from the same files): nothing is left to run, so nothing is built or
        written; ``self.summary`` is the directory's summary.json as it is on rank 0 (one is written
        only when the directory has none, e.g. a checkpoint of another directory). A checkpoint that
        is missing or from another configuration is refused by ``_train``, with the directory's
        summary kept under ``previous``."""
        t = self.cfg.trainer
        if not t.resume:
            return False
        try:
            path = checkpoint.resolve(t.resume, self.run_dir)
            if path is None:
                return False
            meta = checkpoint.read_meta(path)
            checkpoint.check_compatible(meta, self._identity(), path)
        except (ConfigError, OSError, ValueError):
            return False
        if meta["step"] < t.max_steps:
            return False
        self.summary = {}
        if self.rank == 0:
            on_disk = self._summary_on_disk() or {}
            self.summary = run_record(on_disk) or {}
            if self.summary and self.summary is not on_disk:  # a refused resume's record over the run's: the run's back
                outcome.record(self.run_dir, self.summary)
            if not self.summary:
                self.summary = {"status": "ok", "run_id": new_run_id(), "engine": self.cfg.engine.name,
                                "strategy": self.cfg.strategy.selected(), "model": self.cfg.model.name,
                                "params": compose.num_params(self.cfg), "world_size": self.world,
                                "resumed_from": path, "start_step": meta["step"], "steps": 0}
                outcome.record(self.run_dir, self.summary)
            print(f"memopt: nothing to run: checkpoint {path} is at step {meta['step']} and trainer.max_steps="
                  f"{t.max_steps}, so the run is already finished; its summary.json is left as it is (raise "
                  "trainer.max_steps to train further)")
        return True

    def _resume(self, engine, path: str | None) -> int:
        """Restore checkpoint ``path`` (``trainer.resume`` resolved); returns the first step to run (0 without one)."""
        if path is None:
            return 0
        start = checkpoint.load(path, engine, self.rank, self.device)
        self.summary.update(resumed_from=path, start_step=start)
        if self.rank == 0:
            print(f"memopt: resumed from {path} at step {start}", file=sys.stderr)
        return start

    def _save_resumable(self, engine, done: int, guard: DivergenceGuard) -> None:
        meta = {**self._identity(), "run_id": self.run_id, **compose.model_record(self.cfg), "divergence_bad": guard.bad,
                **compose.tokenizer_record(self.cfg)}
        path = checkpoint.save(self.run_dir, done, engine, self.rank, self.device, meta, self.cfg.trainer.keep_checkpoints)
        if path is not None:  # None: the weights were not finite, the previous checkpoint stays the last one
            self.summary["last_checkpoint"] = path

    def _after_step(self, step: int, loss: float, result, engine, guard: DivergenceGuard) -> None:
        """Between two steps: stop a diverged run, write a due checkpoint, stop on SIGTERM / SIGINT."""
        t = self.cfg.trainer
        self.summary["steps_done"] = step + 1
        guard.update(step, loss, result.skipped)  # raises Diverged: no checkpoint of a bad state
        due = bool(t.checkpoint_every) and ((step + 1) % t.checkpoint_every == 0 or step + 1 == t.max_steps)
        self._beat("step boundary (signal vote)", step)
        signum = self.signals.agreed(self.dims.world, self.device)
        if (due or (signum and t.checkpoint_every)) and math.isfinite(loss):
            self._beat("checkpoint save", step)
            self._save_resumable(engine, step + 1, guard)
        if signum:
            from memopt.errors import Interrupted

            where = f"; resume with trainer.resume=auto (checkpoint {self.summary['last_checkpoint']})" \
                if self.summary.get("last_checkpoint") else ""
            raise Interrupted(f"{self.signals.describe(signum)}: stopped after step {step}{where}")

    # ---- the watchdog (memopt.watchdog) -----------------------------------------------------------
    def _start_watchdog(self) -> None:
        """Publish this rank's phase; a single process, or rank 0 under an external launcher, also
        watches (under ``trainer.nproc_per_node`` the launching process does)."""
        limit = self.cfg.trainer.watchdog_s
        if not limit:
            return
        from memopt.watchdog import Heartbeat, Watchdog

        self.heartbeat = Heartbeat(self.run_dir, self.rank, interval=min(1.0, limit / 4))
        if self.rank == 0 and not os.environ.get(WATCHED_BY_LAUNCHER):
            self.watchdog = Watchdog(self.run_dir, limit, self._stalled)

    def _stop_watchdog(self) -> None:
        for w in (self.watchdog, self.heartbeat):
            if w is not None:
                w.close()

    def _where(self) -> str:
        """Where the run was when it stopped (the phase and step of the last heartbeat): ' in <phase> of step N'."""
        phase, step = getattr(self, "_phase", (None, None))
        return "" if phase is None else f" (in {phase}" + ("" if step is None else f" of step {step}") + ")"

    def _beat(self, phase: str, step: int | None = None) -> None:
        self._phase = (phase, step if step is not None else getattr(self, "_phase", (None, None))[1])
        if self.heartbeat is not None:
            self.heartbeat.set(phase, step)

    def _stalled(self, rank: int, message: str, beats: dict) -> None:
        """The watchdog fired in this process: record and exit (the main thread may be blocked for good)."""
        from memopt.errors import EXIT_CODES

        print(f"memopt: {message}", file=sys.stderr)
        if self.rank == 0:
            outcome.record(self.run_dir, {**self.summary, "status": "failed", "error": message, "stalled_rank": rank})
        os._exit(EXIT_CODES["failed"])

    # ------------------------------------------------------------------------------------------
    def save_checkpoint(self, engine) -> str | None:
        """model.pt: the weights in fp32 plus the model config and the architecture strategies' options
        (``compose.model_record``); load with ``memopt.load_model``. A collective: every rank streams
        the weights (``Engine.iter_full_state``), rank 0 writes each as it arrives (``model_file``)."""
        record, items = compose.saved_model(self.cfg, engine.iter_full_state())  # lora: merged, or its adapters alone
        writer = model_file.ModelFileWriter(os.path.join(self.run_dir, "model.pt"), record) if self.rank == 0 else None
        try:
            finite = model_file.stream(engine, writer, items=items)
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        if not finite:
            if writer is not None:
                writer.abort()
            raise Diverged("the final weights hold non-finite values: model.pt was not written (the last "
                           "resumable checkpoint, if any, is the last good state)")
        if writer is None:
            return None
        self.summary["checkpoint"] = writer.commit()
        return self.summary["checkpoint"]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

