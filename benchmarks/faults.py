"""Fault injection: what a run survives, what it loses, and how long it takes to go on.

Runs a fixed list of faults against real trainers on an embedded local Ray (2 CPUs) and
prints, per fault, whether the run survived, what data was lost, and the seconds from the
fault to training (or the state it was in) being whole again; JSON with `--json`.

    python benchmarks/faults.py                 # the table (needs root for the full-disk fault)
    python benchmarks/faults.py --json out.json
"""

from __future__ import annotations

import _thread
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray
import torch
from torch import nn

from raypipe import CheckpointError, LayerSpec, TrainConfig, Trainer
from raypipe.checkpoint.layout import find_valid, list_checkpoints, verify

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
from save_faults import FailOnSave, KillOnSave, moto_s3  # noqa: E402 - layers that die or fail as they save
from toy_models import MLP7 as LAYERS  # noqa: E402
from toy_models import batch  # noqa: E402

QUIET = dict(log=lambda _: None)


def config(root: Path | str | None = None, **changes) -> TrainConfig:
    base = dict(
        pp=2,
        microbatches=2,
        optimizer={"name": "adamw", "lr": 1e-2},
        seed=5,
        checkpoint_dir=str(root) if root else None,
        checkpoint_every=2 if root else 0,
        keep_checkpoints=0,
    )
    return TrainConfig(**{**base, **changes})


def intact(root: Path, steps: list[int]) -> str:
    """'none' when every listed step's checkpoint verifies, else what is missing or broken."""
    lost = []
    for step in steps:
        try:
            verify(root / f"step-{step:08d}")
        except CheckpointError as error:
            lost.append(f"step {step}: {error}")
    return "; ".join(lost) or "none"


def rerun_into_used_directory(work: Path) -> dict:
    root = work / "ck"
    with Trainer(LAYERS, nn.functional.mse_loss, config(root)) as t:
        t.fit(batch, 4, **QUIET)
    started = time.monotonic()
    try:
        Trainer(LAYERS, nn.functional.mse_loss, config(root, seed=2)).shutdown()
        return {"survived": False, "data_lost": "the new run was let in", "recover_s": None}
    except CheckpointError:
        refused = time.monotonic() - started
    with Trainer(LAYERS, nn.functional.mse_loss, config(root, resume=True)) as t:
        t.fit(batch, 6, **QUIET)
    return {
        "survived": True,
        "data_lost": intact(root, [2, 4, 6]),
        "recover_s": refused,
        "detail": "refused before any actor started; resume=True continued the run to step 6",
    }


def disk_full_mid_save(work: Path) -> dict:
    mount = work / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(mount)], capture_output=True).returncode:
        return {"survived": None, "data_lost": None, "recover_s": None, "detail": "skipped: a tmpfs needs root"}
    try:
        root = mount / "ck"
        with Trainer(LAYERS, nn.functional.mse_loss, config(root, keep_checkpoints=1)) as t:
            t.fit(batch, 2, **QUIET)
            free = os.statvfs(mount)
            with open(mount / "junk", "wb") as f:  # the disk fills up: 40 KiB left, a checkpoint needs ~100
                f.write(b"\0" * (free.f_bavail * free.f_frsize - 40 * 1024))
            try:
                t.fit(batch, 4, **QUIET)
                return {"survived": False, "data_lost": "the save did not fail", "recover_s": None}
            except CheckpointError:
                pass
            debris = sorted(p.name for p in root.iterdir() if p.name != "step-00000002")
            lost = intact(root, [2])
            started = time.monotonic()
            (mount / "junk").unlink()  # space freed: the same trainer saves the step it reached
            saved = t.save()
            recover = time.monotonic() - started
        return {
            "survived": not debris and lost == "none" and saved.name == "step-00000004",
            "data_lost": lost if not debris else f"debris left: {debris}",
            "recover_s": recover,
            "detail": "step 4 ran; its save failed with ENOSPC; step 2 intact; saved once space was free",
        }
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, timeout=30)


def actor_killed_mid_save(work: Path) -> dict:
    flag = work / "kill-on-save"
    layers = LAYERS[:4] + [LayerSpec(KillOnSave, str(flag))] + LAYERS[4:]
    root, events = work / "ck", {}

    def on_step(metrics):
        if metrics["step"] == 2 and "armed" not in events:
            events["armed"] = True
            flag.touch()  # the step-4 save kills stage 1

    def log(line):
        if "died during save" in line:
            events["died"] = time.monotonic()

    with Trainer(layers, nn.functional.mse_loss, config(root, max_restarts=1)) as t:
        history = t.fit(batch, 6, on_step=on_step, log=log)
    steps = sorted({m["step"] for m in history})
    end = time.monotonic()
    return {
        "survived": steps == [1, 2, 3, 4, 5, 6] and "died" in events,
        "data_lost": intact(root, [2, 4, 6]),
        "recover_s": end - events["died"] if "died" in events else None,
        "detail": "recovered from step 2, replayed, step 4 saved again (recover_s: death to the run's end)",
    }


def object_store_error_mid_save(work: Path) -> dict:
    """moto's S3 server on 127.0.0.1: step 4's save breaks in stage 1 (an OSError, as a 503 would
    raise) after stage 0 wrote its objects; fit retries the save within max_restarts."""
    with moto_s3("faults") as query:
        root, flag, events = f"s3://key:secret@faults/run?{query}", work / "fail-once", {}
        layers = LAYERS[:4] + [LayerSpec(FailOnSave, str(flag))] + LAYERS[4:]

        def on_step(metrics):
            if metrics["step"] == 3:
                flag.touch()
            if metrics["step"] == 4:  # booked once the retried save is complete
                events["saved"] = time.monotonic()

        def log(line):
            if "retrying the save" in line:
                events["failed"] = time.monotonic()

        with Trainer(layers, nn.functional.mse_loss, config(root, max_restarts=1)) as t:
            history = t.fit(batch, 6, on_step=on_step, log=log)
        names = [p.name for p in list_checkpoints(root)]
        lost = "none" if names == ["step-00000002", "step-00000004", "step-00000006"] else f"found {names}"
        for path in list_checkpoints(root):
            verify(path)
        return {
            "survived": "failed" in events and [m["step"] for m in history] == [1, 2, 3, 4, 5, 6],
            "data_lost": lost,
            "recover_s": events["saved"] - events["failed"] if "failed" in events else None,
            "detail": "the save of step 4 failed mid-write and was retried in place; steps 2, 4, 6 verify",
        }


def sigterm_mid_step(work: Path) -> dict:
    root, events = work / "ck", {}
    t = Trainer(LAYERS, nn.functional.mse_loss, config(root, checkpoint_every=10, name="sigterm"))

    def on_step(metrics):
        if metrics["step"] == 3 and "sent" not in events:
            events["sent"] = time.monotonic()
            threading.Timer(0.002, os.kill, (os.getpid(), signal.SIGTERM)).start()  # lands inside step 4

    try:
        t.fit(batch, 8, on_step=on_step, **QUIET)
    except KeyboardInterrupt:
        events["out"] = time.monotonic()
    step = t.step_count
    released = [g["state"] for g in ray.util.placement_group_table().values() if g["name"] == "raypipe-sigterm"]
    return {
        "survived": "out" in events and not t.group.actors and released == ["REMOVED"],
        "data_lost": intact(root, [step]),
        "recover_s": events.get("out", 0) - events["sent"],
        "detail": f"stopped after step {step}, checkpoint of step {step} written, placement group released",
    }


def ctrl_c_waiting_for_resources(work: Path) -> dict:
    cfg = TrainConfig(pp=2, cpus_per_actor=2.0, actor_start_timeout=120, name="unplaceable")
    threading.Timer(1.0, _thread.interrupt_main).start()
    started = time.monotonic()
    try:
        Trainer(LAYERS, nn.functional.mse_loss, cfg)
    except KeyboardInterrupt:
        pass
    took = time.monotonic() - started - 1.0
    groups = [g["state"] for g in ray.util.placement_group_table().values() if g["name"] == "raypipe-unplaceable"]
    return {
        "survived": groups == ["REMOVED"],
        "data_lost": "none",
        "recover_s": took,
        "detail": f"placement group {groups}: nothing left reserved or pending",
    }


def corrupt_manifests(work: Path, source: Path) -> dict:
    variants = [
        [],
        {"format": 1},
        {"format": 1, "files": []},
        {"format": 1, "files": {"trainer.json": 3}},
        {"format": 1, "files": {"trainer.json": {"bytes": "x", "sha256": None}}},
        {"format": 1, "files": {}},
    ]
    fell_back, started = 0, time.monotonic()
    for i, manifest in enumerate(variants):
        root = work / f"v{i}"
        for name in ("step-00000002", "step-00000004"):
            shutil.copytree(source / name, root / name)
        (root / "step-00000004" / "MANIFEST.json").write_text(json.dumps(manifest))
        fell_back += find_valid(root, warn=lambda _: None)[0].name == "step-00000002"
    return {
        "survived": fell_back == len(variants),
        "data_lost": "none (the corrupt step only)",
        "recover_s": (time.monotonic() - started) / len(variants),
        "detail": f"{fell_back} of {len(variants)} manifest shapes fell back to the previous checkpoint",
    }


def mismatched_load(work: Path, source: Path) -> dict:
    wider = LAYERS[:4] + [LayerSpec(nn.Linear, 16, 10), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 10, 3)]
    with Trainer(wider, nn.functional.mse_loss, config()) as t:
        before = t.state_dict()
        started = time.monotonic()
        try:
            t.load(str(source))
            refused = False
        except CheckpointError:
            refused = True
        took = time.monotonic() - started
        unchanged = all(torch.equal(before[k], v) for k, v in t.state_dict().items())
        usable = t.step(*batch(0))["step"] == 1
    return {
        "survived": refused and unchanged and usable,
        "data_lost": "none" if unchanged else "weights changed",
        "recover_s": took,
        "detail": "refused before any actor changed a weight; the trainer trained on",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(scratch)
        source = base / "source"
        with Trainer(LAYERS, nn.functional.mse_loss, config(source)) as t:
            t.fit(batch, 4, **QUIET)
        faults = {
            "rerun into a used directory": rerun_into_used_directory,
            "disk full mid-save": disk_full_mid_save,
            "object-store error mid-save": object_store_error_mid_save,
            "actor killed mid-save": actor_killed_mid_save,
            "SIGTERM mid-step": sigterm_mid_step,
            "Ctrl-C while waiting for resources": ctrl_c_waiting_for_resources,
            "corrupt manifest (6 shapes)": lambda w: corrupt_manifests(w, source),
            "mismatched load": lambda w: mismatched_load(w, source),
        }
        for name, fault in faults.items():
            work = base / name.replace(" ", "-")
            work.mkdir()
            started = time.monotonic()
            results[name] = fault(work)
            print(f"{name}: {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    ray.shutdown()
    print(f"{'fault':38} {'survived':9} {'recover':>9}  data lost")
    for name, r in results.items():
        survived = {True: "yes", False: "NO", None: "skipped"}[r["survived"]]
        took = f"{r['recover_s']:.2f} s" if r["recover_s"] is not None else "-"
        print(f"{name:38} {survived:9} {took:>9}  {r['data_lost']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
