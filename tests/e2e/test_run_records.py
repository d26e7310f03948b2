"""Run records that cannot be mixed up or misread: a run id on every record, a reused run directory
refused (exit 2) unless the run resumes or overwrites, a diverged run stopped with status
``diverged`` (exit 4) and no non-finite weights written. ``memopt.train.run`` runs in this process
(the CLI's path after Hydra; the run directory is the working directory)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from memopt.errors import EXIT_CODES, ConfigError
from tests.conftest import compose

QUICK = ["logger=none", "trainer.progress_bar=false", "model=gpt_tiny", "model.seq_len=32", "model.n_layer=2",
         "trainer.micro_batch_size=2", "trainer.eval_every=0", "trainer.log_every=1", "trainer.max_steps=2",
         "data=synthetic", "data.synthetic_tokens=20000"]


def cli_run(run_dir, overrides: list[str]) -> int:
    """``python -m memopt.train`` in ``run_dir`` (in this process); returns the exit code."""
    from memopt.train import run

    cwd = os.getcwd()
    os.makedirs(run_dir, exist_ok=True)
    os.chdir(run_dir)
    try:
        run(compose([*QUICK, *overrides]))
        return 0
    except SystemExit as e:
        return int(e.code)
    finally:
        os.chdir(cwd)


def lines(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f]


def test_reused_run_dir_is_refused_unless_overwritten(tmp_path, capsys):
    d = tmp_path / "run"
    assert cli_run(d, ["trainer.max_steps=1"]) == 0
    first = json.loads((d / "summary.json").read_text())
    assert first["status"] == "ok" and {r["run_id"] for r in lines(d)} == {first["run_id"]}

    assert cli_run(d, ["optim.lr=3e-3"]) == EXIT_CODES["refused"] == 2
    err = capsys.readouterr().err
    assert str(d) in err and "trainer.resume=auto" in err and "trainer.overwrite=true" in err
    assert json.loads((d / "summary.json").read_text()) == first  # the old run's records are untouched
    assert len(lines(d)) == 1
    # resuming a run that left no checkpoint would restart from step 0 into its records: refused too
    assert cli_run(d, ["trainer.resume=auto", "trainer.max_steps=1"]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    assert json.loads((d / "summary.json").read_text()) == first and len(lines(d)) == 1

    assert cli_run(d, ["trainer.overwrite=true", "trainer.max_steps=1"]) == 0
    second = json.loads((d / "summary.json").read_text())
    assert second["run_id"] != first["run_id"] and {r["run_id"] for r in lines(d)} == {second["run_id"]}


def test_a_refused_or_planned_command_leaves_its_directory_to_the_next(tmp_path, capsys):
    """A command refused at the gate, or run in plan mode, trains nothing and leaves only its summary: the
    user who fixes the command (or trains what was planned) into the same directory runs there, its records
    replacing that summary. Before, the directory "already held a run" (exit 2) and resuming it was
    suggested, with nothing to resume. A directory whose run trained is still refused (the test above)."""
    d = tmp_path / "run"
    assert cli_run(d, ["trainer.max_steps=1", "model.dropout=1.5"]) == EXIT_CODES["refused"]
    assert json.loads((d / "summary.json").read_text())["status"] == "refused"
    assert cli_run(d, ["trainer.max_steps=1"]) == 0, capsys.readouterr().err
    ran = json.loads((d / "summary.json").read_text())
    assert ran["status"] == "ok" and {r["run_id"] for r in lines(d)} == {ran["run_id"]}

    p = tmp_path / "planned"
    assert cli_run(p, ["trainer.mode=plan", "hardware=a100_80g"]) == 0
    assert json.loads((p / "summary.json").read_text())["mode"] == "plan"
    assert cli_run(p, ["trainer.max_steps=1"]) == 0, capsys.readouterr().err
    ran = json.loads((p / "summary.json").read_text())
    assert ran["status"] == "ok" and "mode" not in ran and len(lines(p)) == 1
    assert cli_run(p, ["trainer.max_steps=1", "optim.lr=3e-3"]) == EXIT_CODES["refused"]  # now it holds a run
    assert "already holds a run" in capsys.readouterr().err


def test_divergence_stops_the_run_and_keeps_no_bad_weights(tmp_path):
    """optim.lr=1e4 gives non-finite losses within a few steps: the run stops with status diverged
    (exit 4) after trainer.divergence_steps of them, writes no model.pt, and every checkpoint it kept
    holds finite weights."""
    from memopt.checkpoint import complete, merge

    d = tmp_path / "run"
    code = cli_run(d, ["optim.lr=1e4", "optim.warmup_steps=0", "trainer.max_steps=12", "trainer.divergence_steps=2",
                       "trainer.checkpoint_every=1", "trainer.keep_checkpoints=12"])
    s = json.loads((d / "summary.json").read_text())
    assert code == EXIT_CODES["diverged"] == 4, s
    assert s["status"] == "diverged" and "2 consecutive steps" in s["error"] and "optim.lr" in s["error"]
    assert not (d / "model.pt").exists()
    losses = [r["loss"] for r in lines(d)]
    assert losses[-1] is None and losses[-2] is None  # non-finite values are recorded as null
    assert s["steps_done"] == len(losses) < 12
    for step, path in complete(str(d)):
        assert step < len(losses)
        w = torch.load(merge(path, str(tmp_path / f"m{step}.pt")), weights_only=True)["state_dict"]
        assert all(bool(torch.isfinite(v).all()) for v in w.values()), step


@pytest.mark.parametrize("field,value", [("checkpoint_every", -1), ("keep_checkpoints", 0), ("divergence_steps", -2)])
def test_trainer_record_fields_are_validated(field, value):
    from memopt.config import ConfigError, to_dataclass, validate

    with pytest.raises(ConfigError, match=f"trainer.{field}={value}"):
        validate(to_dataclass(compose([*QUICK, f"trainer.{field}={value}"])))


def test_checkpoints_of_deepspeed_moe_are_refused():
    from memopt.config import ConfigError, to_dataclass, validate

    with pytest.raises(ConfigError, match=r"resumable checkpoints .* with \+strategy=moe and engine=deepspeed are not built"):
        validate(to_dataclass(compose([*QUICK, "model=moe_tiny", "engine=deepspeed", "+strategy=zero2",
                                       "trainer.checkpoint_every=2"])))


def test_a_checkpoint_from_another_configuration_is_refused():
    from memopt.checkpoint import check_compatible
    from memopt.config import ConfigError

    meta = {"world_size": 2, "engine": "memopt", "strategy": ["zero2"], "model": "gpt_tiny"}
    check_compatible(meta, dict(meta), "ck")
    with pytest.raises(ConfigError, match=r"checkpoint ck cannot resume this run \(world_size: checkpoint 2, this run 1\)"):
        check_compatible(meta, {**meta, "world_size": 1}, "ck")


def test_resume_from_a_missing_checkpoint_is_refused(tmp_path):
    d = tmp_path / "run"
    assert cli_run(d, [f"trainer.resume={tmp_path}/nowhere"]) == 2
    s = json.loads((d / "summary.json").read_text())
    assert s["status"] == "refused" and "trainer.resume=" in s["error"] and "nowhere" in s["error"]


@pytest.mark.slow
def test_divergence_count_continues_after_resume(tmp_path):
    """A loss scale of 2^60 overflows every fp16 step (finite losses, skipped steps). 2 skipped steps
    end a 2-step run (limit 3) with a checkpoint; resumed to 6 steps, the first step is the third bad
    one in a row: diverged at steps_done 3 (a count restarting at 0 would stop at 5)."""
    d = tmp_path / "run"
    common = ["+strategy=fp16", "strategy.fp16.init_scale=1.152921504606847e18", "trainer.divergence_steps=3",
              "trainer.checkpoint_every=2", "trainer.eval_every=0"]
    assert cli_run(d, [*common, "trainer.max_steps=2"]) == 0
    assert all(r["skipped_steps"] > 0 for r in lines(d))
    assert cli_run(d, [*common, "trainer.max_steps=6", "trainer.resume=auto"]) == EXIT_CODES["diverged"]
    s = json.loads((d / "summary.json").read_text())
    assert s["status"] == "diverged" and s["steps_done"] == 3 and "3 consecutive steps" in s["error"], s


@pytest.mark.slow
def test_fp16_steps_all_skipped_is_diverged(tmp_path):
    """fp16 with optim.lr=1e4: every step overflows and is skipped; status diverged, exit 4."""
    d = tmp_path / "run"
    code = cli_run(d, ["+strategy=fp16", "optim.lr=1e4", "optim.warmup_steps=0", "trainer.max_steps=40",
                       "trainer.divergence_steps=4"])
    s = json.loads((d / "summary.json").read_text())
    assert code == 4 and s["status"] == "diverged", s
    assert "4 consecutive steps" in s["error"] and not (d / "model.pt").exists()
    assert all(r["skipped_steps"] > 0 for r in lines(d)[-4:])


@pytest.mark.slow
def test_chunk_engine_host_memory_refusal_is_refused(tmp_path):
    """gpt_10b with the chunk engine on a 24 GB host: known at build before any chunk is allocated,
    so the status is refused (a ConfigError), not oom."""
    from memopt.api import run_job
    from memopt.config import ConfigError

    with pytest.raises(ConfigError, match=r"chunks need up to .* GiB on the host .* host budget is 19.20 GiB"):
        run_job(["logger=none", "trainer.progress_bar=false", "model=gpt_10b", "+strategy=chunk", "trainer.max_steps=1",
                 "trainer.micro_batch_size=1", "model.seq_len=64", "trainer.eval_every=0", "hardware.host_memory_gb=24"],
                str(tmp_path))
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["status"] == "refused" and EXIT_CODES[s["status"]] == 2


def test_checkpoints_are_ordered_by_when_they_were_written(tmp_path):
    """A run resumed from step_5 while step_10 of the abandoned attempt is still on disk writes step_7:
    resume=auto must continue from step_7 (the newest written), and pruning removes step_10 before it."""
    import os

    from memopt.checkpoint import META, complete, resolve, root

    for i, step in enumerate((5, 10, 7)):  # written in this order
        d = os.path.join(root(str(tmp_path)), f"step_{step}")
        os.makedirs(d)
        with open(os.path.join(d, META), "w") as f:
            json.dump({"step": step}, f)
        os.utime(os.path.join(d, META), (1000 + i, 1000 + i))
    assert [s for s, _ in complete(str(tmp_path))] == [5, 10, 7]
    assert resolve("auto", str(tmp_path)).endswith("step_7")
    # true (as a Hugging Face user types it, which Hydra hands over as 'True'): the newest too; false: none
    assert resolve("True", str(tmp_path)).endswith("step_7") and resolve("false", str(tmp_path)) is None
    empty = tmp_path / "empty"
    assert resolve("auto", str(empty)) is None  # auto starts from step 0 where there is none; true is refused
    with pytest.raises(ConfigError, match=r"trainer.resume=true: this run directory .* has no checkpoint"):
        resolve("True", str(empty))


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_resuming_a_finished_run_is_a_no_op_and_a_refused_resume_keeps_the_record(tmp_path, capfd, nproc):
    """A run of 1 step with its final checkpoint. Resumed with the same configuration and max_steps=1:
    nothing is left to run, so exit 0, a message on stdout, and summary.json and metrics.jsonl exactly
    as the run left them. Resumed with another configuration (+strategy=ckpt), the checkpoint is
    refused inside the rank (exit 2): the refusal is recorded and the run's summary is kept whole under
    ``previous``; the metrics stay. On 2 ranks every rank decides the same from the files."""
    d = tmp_path / "run"
    one = ["trainer.checkpoint_every=1", "trainer.max_steps=1", f"trainer.nproc_per_node={nproc}"]
    assert cli_run(d, one) == 0
    first = (d / "summary.json").read_bytes()
    metrics = (d / "metrics.jsonl").read_bytes()
    assert json.loads(first)["status"] == "ok" and len(lines(d)) == 1
    capfd.readouterr()

    assert cli_run(d, [*one, "trainer.resume=auto"]) == 0
    out = capfd.readouterr().out
    assert "nothing to run" in out and "step 1" in out and "trainer.max_steps=1" in out, out
    assert (d / "summary.json").read_bytes() == first and (d / "metrics.jsonl").read_bytes() == metrics

    assert cli_run(d, [*one, "trainer.resume=auto", "+strategy=ckpt", "trainer.max_steps=2"]) == EXIT_CODES["refused"]
    s = json.loads((d / "summary.json").read_text())
    assert s["status"] == "refused" and "cannot resume this run" in s["error"] and "strategy" in s["error"], s
    assert s["previous"] == json.loads(first) and (d / "metrics.jsonl").read_bytes() == metrics
    err = capfd.readouterr().err  # a refusal inside the ranks: one line, no rank's or launcher's traceback
    assert "Traceback" not in err and "cannot resume this run" in err.strip().splitlines()[-1], err[-2000:]
    if nproc == 1:  # a second refusal keeps the run's record, not the first refusal's; a no-op resume brings it back
        assert cli_run(d, [*one, "trainer.resume=auto", "+strategy=ckpt", "trainer.max_steps=2"]) == EXIT_CODES["refused"]
        assert json.loads((d / "summary.json").read_text())["previous"] == json.loads(first)
        capfd.readouterr()
        assert cli_run(d, [*one, "trainer.resume=auto"]) == 0
        assert json.loads((d / "summary.json").read_text()) == json.loads(first)
        out = capfd.readouterr().out
        assert "nothing to run" in out and "refused" not in out, out


def test_a_refused_run_leaves_the_directorys_hydra_record_as_it_was(tmp_path, capsys):
    """Hydra writes ``.hydra/`` before memopt can refuse the directory: the owning run's files are put
    back, so the directory (and a report's labels) still describe the run it holds. The CLI's entry
    point runs in this process, Hydra included."""
    import yaml

    from tests.conftest import cli_main

    d = tmp_path / "run"
    cmd = [*QUICK, "trainer.max_steps=1", f"hydra.run.dir={d}"]
    assert cli_main([*cmd, "seed=0"]) == 0
    before = {f: (d / ".hydra" / f).read_text() for f in ("config.yaml", "overrides.yaml")}
    assert cli_main([*cmd, "seed=7", "optim.lr=5e-4"]) == 2 and "already holds a run" in capsys.readouterr().err
    assert {f: (d / ".hydra" / f).read_text() for f in before} == before
    assert "seed=0" in yaml.safe_load(before["overrides.yaml"])


def test_a_damaged_checkpoint_is_refused_naming_its_file_without_a_traceback(tmp_path, capsys):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "meta.json").write_bytes(bytes(range(256)))  # not UTF-8, not JSON
    d = tmp_path / "run"
    assert cli_run(d, [f"trainer.resume={ck}"]) == EXIT_CODES["refused"]
    s = json.loads((d / "summary.json").read_text())
    assert s["status"] == "refused" and str(ck / "meta.json") in s["error"] and "damaged" in s["error"]
    assert "Traceback" not in capsys.readouterr().err


def test_a_full_disk_during_a_checkpoint_save_leaves_a_true_record(tmp_path, capsys, monkeypatch):
    """ENOSPC at the second save's write (simulated at DCP's write call): status failed, a one-line reason
    naming the checkpoint and the free space, the partial files removed, the first checkpoint intact and
    resumable, summary.json written."""
    import errno

    import torch.distributed.checkpoint as dcp

    from memopt import checkpoint

    real, calls = dcp.save, []

    def full_disk(state, checkpoint_id):
        calls.append(checkpoint_id)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(str(checkpoint_id), "__0_0.distcp"))
        return real(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(dcp, "save", full_disk)
    d = tmp_path / "run"
    assert cli_run(d, ["trainer.checkpoint_every=1", "trainer.max_steps=3"]) == EXIT_CODES["failed"]
    s = json.loads((d / "summary.json").read_text())
    assert s["status"] == "failed" and "checkpoint step 2" in s["error"] and "No space left" in s["error"]
    assert "free there" in s["error"] and "step_1" in s["error"]
    err = capsys.readouterr().err
    assert "Traceback" not in err and "checkpoint step 2 could not be written" in err
    assert sorted(os.listdir(d / "checkpoints")) == ["step_1"]  # no .tmp-step_2 left filling the disk
    assert not [f for f in os.listdir(d) if ".tmp-" in f]
    assert [c for c, _ in checkpoint.complete(str(d))] == [1]
    monkeypatch.setattr(dcp, "save", real)  # space freed: the run continues from step 1
    assert cli_run(d, ["trainer.checkpoint_every=1", "trainer.max_steps=3", "trainer.resume=auto"]) == 0
    assert json.loads((d / "summary.json").read_text())["status"] == "ok"


def test_a_sequence_longer_than_the_data_is_refused_as_data_not_memory(tmp_path, capsys):
    """model.seq_len beyond the corpus is a data error: refused naming the field, without the memory
    candidates the preflight tries when a composition does not fit (it said "none of 12 candidate
    compositions fits")."""
    d = tmp_path / "run"
    assert cli_run(d, ["model.seq_len=100000"]) == EXIT_CODES["refused"]
    s = json.loads((d / "summary.json").read_text())
    assert s["status"] == "refused" and "model.seq_len + 1 = 100001" in s["error"], s["error"]
    assert "candidate" not in s["error"] and "this fits" not in s["error"]
    assert "Traceback" not in capsys.readouterr().err


def test_merge_of_a_path_without_a_checkpoint_names_its_argument(tmp_path, capsys):
    from memopt.checkpoint import main

    assert main(["merge", str(tmp_path / "nothing"), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint='{tmp_path / 'nothing'}'" in err and "trainer.resume" not in err and "Traceback" not in err
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.slow
def test_a_save_failing_on_one_of_two_ranks_ends_both_at_once(tmp_path):
    """One rank's files of a checkpoint fail (ENOSPC, injected after its shard) while the other's succeed:
    the ranks agree on the failure before waiting for each other's files, so the job ends at once (it sat at
    the save's barrier until the watchdog) with the failing rank's reason, the partial files removed and
    the previous checkpoint intact."""
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    d = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=REPO, WANDB_MODE="offline", MEMOPT_FAULT_SAVE_ENOSPC="2:1")
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "memopt.train", f"hydra.run.dir={d}", *QUICK, "trainer.nproc_per_node=2",
                        "trainer.checkpoint_every=1", "trainer.max_steps=3"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert time.time() - t0 < 120 and p.returncode == EXIT_CODES["failed"], p.stderr[-3000:]
    s = json.loads((d / "summary.json").read_text())
    assert s["status"] == "failed" and "checkpoint step 2" in s["error"] and "(rank 1)" in s["error"], s["error"]
    assert "No space left" in s["error"] and "Traceback" not in p.stderr
    assert sorted(os.listdir(d / "checkpoints")) == ["step_1"]


def test_a_full_disk_while_writing_the_metrics_stops_with_one_line(tmp_path, capsys, monkeypatch):
    """ENOSPC at metrics.jsonl's second record (simulated at the file's write): status failed, one line
    naming the file, the reason and the free space, no traceback, the checkpoint before it intact."""
    import errno

    from memopt import logging as records

    real_init = records.RunLogger.__init__

    class FullAfterOne:
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, text):
            self.n += 1
            if self.n == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(text)

        def close(self):
            self.f.close()

    def init(self, *a, **k):
        real_init(self, *a, **k)
        if self.enabled:
            self._metrics = FullAfterOne(self._metrics)

    monkeypatch.setattr(records.RunLogger, "__init__", init)
    d = tmp_path / "run"
    assert cli_run(d, ["trainer.checkpoint_every=1", "trainer.max_steps=3"]) == EXIT_CODES["failed"]
    s = json.loads((d / "summary.json").read_text())
    assert s["status"] == "failed" and "metrics.jsonl" in s["error"] and "No space left" in s["error"], s["error"]
    assert "free there" in s["error"] and "trainer.resume=auto" in s["error"]
    assert "Traceback" not in capsys.readouterr().err
    assert "step_1" in os.listdir(d / "checkpoints")
