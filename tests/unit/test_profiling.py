"""``trainer.profile_step``: one step under torch.profiler, by phase and op, out of the step-time medians."""
from __future__ import annotations

import json
import statistics
from types import SimpleNamespace

import pytest

from memopt.config import ConfigError
from tests.conftest import train, typed

TINY = ["model=gpt_tiny", "model.n_layer=2", "model.seq_len=32", "trainer.micro_batch_size=2", "trainer.grad_accum=3",
        "trainer.eval_every=0", "trainer.log_every=1", "trainer.throughput_warmup_steps=0", "trainer.max_steps=4",
        "data=synthetic", "data.synthetic_tokens=20000"]


def test_a_profiled_step_counts_the_models_ops_and_stays_out_of_the_medians(tmp_path):
    """Without the tracker, the profile of step 1 holds each block's attention once per micro-batch forward and once
    backward (2 blocks x 3 micro-batches: the model's own count), the forward/backward phase longer than the
    optimizer step's, its files; the run's median step is the median of the other steps' times."""
    d = tmp_path / "run"
    s = train([*TINY, "trainer.profile_step=1", "trainer.track_memory=false"], str(d))
    assert s["status"] == "ok" and s["profile"]["step"] == 1
    rec = json.loads((d / "profile" / "rank0_step1.json").read_text())
    calls = {r["name"]: r["calls"] for r in rec["top_ops"]}
    attn = [n for n in calls if n.startswith("aten::_scaled_dot_product") and not n.endswith("_backward")]
    assert attn and sum(calls[n] for n in attn) == 2 * 3, calls
    assert sum(calls[n + "_backward"] for n in attn if n + "_backward" in calls) == 2 * 3, calls
    fb, opt = rec["phases"]["forward_backward"], rec["phases"]["optimizer_step"]
    assert fb["calls"] == opt["calls"] == 1 and fb["cpu_us"] > opt["cpu_us"] > 0 and "note" not in rec
    assert (d / "profile" / "rank0_step1.trace.json").stat().st_size > 0
    assert "aten::" in (d / "profile" / "rank0_step1.txt").read_text()
    times = {r["step"]: r["step_time_s"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
             if "step_time_s" in r}
    assert sorted(times) == [0, 1, 2, 3]
    assert s["step_time_s"] == pytest.approx(statistics.median([times[0], times[2], times[3]]))


def test_the_tracker_s_double_dispatch_is_said_and_the_trace_is_optional(tmp_path):
    d = tmp_path / "run"
    s = train([*TINY, "trainer.profile_step=3", "trainer.profile_trace=false"], str(d))
    assert s["status"] == "ok" and s["profile"]["step"] == 3
    assert not (d / "profile" / "rank0_step3.trace.json").exists()
    assert "memory tracker was on" in json.loads((d / "profile" / "rank0_step3.json").read_text())["note"]


def test_a_step_the_run_does_not_have_is_refused():
    with pytest.raises(ConfigError, match=r"trainer.profile_step=4: give a step of this run, 0 to 3"):
        typed(["trainer.max_steps=4", "trainer.profile_step=4"])
    assert typed(["trainer.max_steps=4", "trainer.profile_step=-1"]).trainer.profile_step == -1


def test_on_a_gpu_ops_are_ranked_by_their_device_time():
    """Averages as torch.profiler gives them with CUDA: host ops whose self device time is the kernels they launched,
    each kernel and copy again as a device-side row, each range twice (its host row, and a device-side annotation
    whose time is its span); ``cuda_*`` names before torch 2.4. The host ops are ranked by device time whatever
    their host time, their share is of the kernels' total (as torch's own table counts it: 750 us, not twice that),
    and a phase keeps its host times beside its device time and span."""
    from torch.autograd import DeviceType

    from memopt.profiling import format_table, summarize

    def evt(key, self_cpu, self_dev, dev, side=DeviceType.CPU, annotation=False, old=False):
        names = ("self_cuda_time_total", "cuda_time_total") if old else ("self_device_time_total", "device_time_total")
        return SimpleNamespace(key=key, count=1, self_cpu_time_total=self_cpu, cpu_time_total=self_cpu, device_type=side,
                               is_user_annotation=annotation, **dict(zip(names, (self_dev, dev))))

    gpu = DeviceType.CUDA
    rec = summarize([evt("aten::copy_", 900.0, 50.0, 50.0), evt("aten::mm", 10.0, 700.0, 700.0, old=True),
                     evt("sm90_xmma_gemm_bf16", 0.0, 700.0, 700.0, side=gpu), evt("Memcpy DtoH", 0.0, 50.0, 50.0, side=gpu),
                     evt("memopt.forward_backward", 1000.0, 0.0, 750.0),
                     evt("memopt.forward_backward", 0.0, 900.0, 900.0, side=gpu, annotation=True)], on_device=True)
    assert [r["name"] for r in rec["top_ops"]] == ["aten::mm", "aten::copy_"] and rec["sorted_by"] == "self_device_us"
    assert rec["total_self_us"] == 750.0
    fb = rec["phases"]["forward_backward"]
    assert (fb["cpu_us"], fb["device_us"], fb["device_span_us"]) == (1000.0, 750.0, 900.0)
    table = format_table({**rec, "step": 5, "rank": 0})
    assert "host        1,000" in table and "device          750 (span 900)" in table and "93.3%" in table


def test_a_profiler_that_cannot_start_leaves_the_run_going(tmp_path, monkeypatch):
    """No CUPTI, another profiler running: the step trains unprofiled, the record names the reason."""
    import torch.profiler

    def refuse(*a, **k):
        raise RuntimeError("profiler already enabled")

    monkeypatch.setattr(torch.profiler, "profile", refuse)
    with pytest.warns(UserWarning, match="the profiler did not start"):
        s = train([*TINY, "trainer.profile_step=2", "trainer.track_memory=false"], str(tmp_path / "run"))
    assert s["status"] == "ok" and "profiler already enabled" in s["profile"]["error"] and s["profile"]["files"] == []


def test_the_warm_up_steps_stay_out_of_the_medians_beside_the_profiled_one(tmp_path):
    """Two warm-up steps and step 1 profiled: the median is of steps 2 and 3 (dropping the profiled step first had
    shifted the warm-up window and left step 3 alone); the profiled step's record says it was."""
    d = tmp_path / "run"
    s = train([*TINY, "trainer.throughput_warmup_steps=2", "trainer.profile_step=1", "trainer.track_memory=false"], str(d))
    recs = {r["step"]: r for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if "step_time_s" in r}
    assert s["step_time_s"] == pytest.approx(statistics.median([recs[2]["step_time_s"], recs[3]["step_time_s"]]))
    assert [n for n, r in sorted(recs.items()) if r.get("profiled")] == [1]


def test_a_step_that_raises_while_profiled_leaves_no_profiler_running(tmp_path, monkeypatch):
    """torch allows one profiler a process: a failed job's must not be left on for the next job in the process."""
    import torch

    from memopt.data import TokenBatches

    real = TokenBatches.micro_batch

    def failing(self, step, *a, **k):
        if step == 1:
            raise RuntimeError("a data error in the profiled step")
        return real(self, step, *a, **k)

    monkeypatch.setattr(TokenBatches, "micro_batch", failing)
    try:
        s = train([*TINY, "trainer.profile_step=1", "trainer.track_memory=false"], str(tmp_path / "run"))
        assert s["status"] == "failed"
    except RuntimeError as e:
        assert "profiled step" in str(e)
    assert not torch.autograd.profiler._is_profiler_enabled
    monkeypatch.setattr(TokenBatches, "micro_batch", real)
    assert train([*TINY, "trainer.profile_step=1", "trainer.track_memory=false"], str(tmp_path / "next"))["profile"]["files"]
