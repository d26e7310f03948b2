"""``hardware.rates_file``: the first plan measures this CPU's step-time rates and writes them; a later plan (another
process: here the process's caches emptied) reads them and measures nothing, so several searches rank by one
reading. The probes are replaced by a fake reading (they take 12-20 s; their own tests are in test_step_time.py);
the reference is the reading the first plan used."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from memopt.config import ConfigError
from tests.conftest import cli_main, typed

TINY = ["model=gpt_tiny", "model.n_layer=2", "model.seq_len=32", "trainer.micro_batch_size=1", "logger=none",
        "data=synthetic", "data.synthetic_tokens=20000"]


def _new_process(monkeypatch, probes):
    """This process as a new one would start: no cached reading (the probes' and the matmul peaks'), and the
    probes replaced by ``probes(profile, hw)``."""
    from memopt.memory import hardware
    from memopt.planner import cpu_rates

    monkeypatch.setattr(cpu_rates, "_CACHE", {})
    monkeypatch.setattr(hardware, "_MEASURED", {})
    monkeypatch.setattr(cpu_rates, "complete", lambda profile, hw, device, model=None: probes(profile, hw))


def _reading(scale: float):
    """A fake reading of the probes: values no real probe gives, different per ``scale``."""
    def probes(profile, hw):
        return replace(hw, ranks_share_device=True, compute_efficiency=0.4321 * scale, memory_gbps=17.5 * scale,
                       op_overhead_us=profile.op_overhead_us or 9.25 * scale, host_adam_gparams_s=0.75 * scale,
                       dtype_efficiency={"bf16": 0.3 * scale}, collective_gbps_by_kind={"all_reduce": 1.25 * scale},
                       collective_latency_us_by_kind={"all_reduce": 800.0 * scale},
                       peak_tflops={k: v * 1.5 for k, v in hw.peak_tflops.items()})
    return probes


def _measuring_forbidden(profile, hw):
    raise AssertionError("the rates were measured again where the file holds them")


def test_a_later_plan_reads_the_first_plans_rates_and_measures_nothing(tmp_path, monkeypatch):
    from memopt.gate import hardware
    from memopt.planner.plan import make_plan

    path = tmp_path / "rates.json"
    cfg = typed([*TINY, f"hardware.rates_file={path}", "+strategy=ddp", "trainer.mode=plan"])
    _new_process(monkeypatch, _reading(1.0))
    first = hardware(cfg, step_rates=True)
    assert first.compute_efficiency == pytest.approx(0.4321) and path.exists()
    _new_process(monkeypatch, _measuring_forbidden)  # another process: its peaks measured anew, no probe may run
    again = hardware(cfg, step_rates=True)
    assert again == first  # every rate, the matmul peaks the efficiencies are fractions of included
    assert make_plan(cfg, again)["step_time"] == make_plan(cfg, first)["step_time"]
    other = typed([*TINY, f"hardware.rates_file={path}", "+strategy=zero2", "trainer.mode=plan"])
    assert hardware(other, step_rates=True) == first  # another composition of the same model: the same reading


def test_each_probe_shape_and_given_rate_has_its_own_entry(tmp_path, monkeypatch):
    """The probes time a block at the model's shapes, and a profile's own rate feeds them: a plan at other shapes or
    with another given rate measures and adds its entry; the first entry is still what its plans read."""
    from memopt.gate import hardware

    path = tmp_path / "rates.json"
    base = [*TINY, f"hardware.rates_file={path}", "trainer.mode=plan"]
    _new_process(monkeypatch, _reading(1.0))
    first = hardware(typed(base), step_rates=True)
    _new_process(monkeypatch, _reading(2.0))
    longer = hardware(typed([*base, "model.seq_len=64"]), step_rates=True)
    given = hardware(typed([*base, "hardware.op_overhead_us=3.5"]), step_rates=True)
    assert longer.compute_efficiency == given.compute_efficiency == pytest.approx(2 * 0.4321)
    assert given.op_overhead_us == 3.5
    assert len(json.loads(path.read_text())) == 3
    _new_process(monkeypatch, _measuring_forbidden)
    assert hardware(typed(base), step_rates=True) == first
    assert hardware(typed([*base, "model.seq_len=64"]), step_rates=True) == longer


def test_a_plan_through_the_cli_ranks_by_the_files_rates(tmp_path, monkeypatch, capsys):
    """``python -m memopt.train ... trainer.mode=plan hardware.rates_file=F`` (its path in this process): the second
    plan says where its rates come from, runs no probe, and its step time is the first's."""
    path, plans = tmp_path / "rates.json", []
    for i, probes in enumerate((_reading(1.0), _measuring_forbidden)):
        _new_process(monkeypatch, probes)
        d = tmp_path / f"plan{i}"
        assert cli_main([*TINY, "+strategy=ddp", "trainer.mode=plan", f"hardware.rates_file={path}",
                         f"hydra.run.dir={d}"]) == 0
        plans.append(json.loads((d / "plan.json").read_text()))
    assert "rates read from hardware.rates_file=" in capsys.readouterr().err
    assert plans[1]["step_time"] == plans[0]["step_time"]
    assert plans[0]["step_time"]["total_s"] > 0


@pytest.mark.parametrize("content, what", [("not json", "cannot be read"), ("[1, 2]", "not a JSON object")])
def test_an_unreadable_rates_file_is_refused_naming_it(tmp_path, content, what):
    path = tmp_path / "rates.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=f"hardware.rates_file={path}.*{what}"):
        typed([*TINY, f"hardware.rates_file={path}"])


def test_a_rates_file_in_a_missing_folder_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="hardware.rates_file=.*does not exist"):
        typed([*TINY, f"hardware.rates_file={tmp_path / 'nowhere' / 'rates.json'}"])


def test_a_profile_with_its_own_peaks_neither_reads_nor_writes_the_file(tmp_path, capsys):
    """Another machine's profile (its peaks given) is planned with its own rates: the file is not this CPU's
    business there, and saying so keeps a user from thinking it was read."""
    from memopt.gate import hardware

    path = tmp_path / "rates.json"
    path.write_text(json.dumps({}))
    profile = typed([*TINY, "hardware=a100_80g", f"hardware.rates_file={path}"])
    hw = hardware(profile, step_rates=True)  # the real cpu_rates.complete: it keeps such a profile as it is
    assert json.loads(path.read_text()) == {} and hw.compute_efficiency == profile.hardware.compute_efficiency
    assert "not used" in capsys.readouterr().err


def test_an_entry_missing_a_rate_is_measured_again(tmp_path, monkeypatch):
    """An entry written before a rate joined the file (or cut short by hand) would leave that term unestimated:
    it is measured again and replaced."""
    from memopt.gate import hardware

    path = tmp_path / "rates.json"
    cfg = typed([*TINY, f"hardware.rates_file={path}", "trainer.mode=plan"])
    _new_process(monkeypatch, _reading(1.0))
    hardware(cfg, step_rates=True)
    entries = json.loads(path.read_text())
    (entry,) = entries
    del entries[entry]["memory_gbps"]
    path.write_text(json.dumps(entries))
    _new_process(monkeypatch, _reading(2.0))
    assert hardware(cfg, step_rates=True).memory_gbps == pytest.approx(2 * 17.5)
    assert json.loads(path.read_text())[entry]["memory_gbps"] == pytest.approx(2 * 17.5)


def _plan_in_a_process(path: str, log: str) -> float:
    """A process of its own planning with ``path``: its probes (a fake reading that takes a second and says in
    ``log`` that it ran, with this process's id in its value) return the compute efficiency it planned with."""
    import os
    import time

    from memopt.gate import hardware
    from memopt.planner import cpu_rates

    def probes(profile, hw, device, model=None):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(1.0)
        return replace(_reading(1.0)(profile, hw), compute_efficiency=1 / (os.getpid() % 1000 + 2))

    cpu_rates.complete = probes
    return hardware(typed([*TINY, f"hardware.rates_file={path}", "trainer.mode=plan"]), step_rates=True).compute_efficiency


def test_two_plans_started_together_share_one_reading(tmp_path):
    """Two searches of one launch start at once (two commands, or every rank of an external launcher): the second
    waits on the file's lock while the first measures, then reads its reading: one process measured, both planned
    with its values."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    path, log = str(tmp_path / "rates.json"), str(tmp_path / "measured.log")
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        got = list(pool.map(_plan_in_a_process, [path, path], [log, log]))
    with open(log) as f:
        assert len(f.read().split()) == 1  # without the lock both find no entry and both measure
    assert got[0] == got[1]


def test_an_entry_with_a_rate_the_plan_cannot_use_refuses_the_plan_with_its_record(tmp_path, monkeypatch):
    """An entry edited by hand to a compute efficiency over 1 (the fraction of the peak a step reaches): plan mode
    through the CLI ends ``refused``, its summary.json naming the file, and no probe runs."""
    path = tmp_path / "rates.json"
    _new_process(monkeypatch, _reading(1.0))
    assert cli_main([*TINY, "trainer.mode=plan", f"hardware.rates_file={path}", f"hydra.run.dir={tmp_path / 'a'}"]) == 0
    entries = json.loads(path.read_text())
    for rates in entries.values():
        rates["compute_efficiency"] = 5.0
    path.write_text(json.dumps(entries))
    _new_process(monkeypatch, _measuring_forbidden)
    cli_main([*TINY, "trainer.mode=plan", f"hardware.rates_file={path}", f"hydra.run.dir={tmp_path / 'b'}"])
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["status"] == "refused" and f"hardware.rates_file={path}" in summary["error"]
    assert "compute_efficiency=5.0" in summary["error"]
