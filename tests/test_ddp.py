"""mparlib.ddp and ddp_train: DDP on CPU processes (gloo) matches one process, resumes exactly, runs as two "nodes",
fails clearly, and leaves the process that ran it as it was.

Every run here is tiny (an MLP, a few hundred Fashion-MNIST images, 2 processes with one thread each): what is
tested is the arithmetic and the plumbing, not the speed.
"""
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from children import make_child_env
from launch_workers import one_step
from mparlib import ddp, launch, rendezvous, throughput
from mparlib.checkpoint import load_checkpoint
from mparlib.ddp_train import DDPConfig, check_run, make_model, train_worker
from mparlib.errors import CheckpointError, ConfigError, LaunchError, OutputLocked, TrainingDiverged, WorkerFailed
from mparlib.runfolder import lock_folder, read_checkpoint
from mparlib.sources import locate, read_split

PY = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# A small run: 2 epochs of 192 images, global batch 32 (16 per rank) = 6 steps per epoch; momentum makes the
# optimizer state matter on resume.
RUN = dict(model="mlp", epochs=2, batch_size=32, lr=0.2, momentum=0.9, subset=(192, 48), seed=3, plot=False)
CLI = ["--model", "mlp", "--epochs", "2", "--batch-size", "32", "--lr", "0.2", "--momentum", "0.9",
       "--subset", "192,48", "--seed", "3", "--no-plot"]


def params_of(checkpoint):
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def reference_training(model, epochs, batch_size, lr, momentum, subset, seed, **_):
    """The same training in one plain process, no DDP: full global batches in DistributedSampler's documented
    order (a permutation drawn from a generator seeded with seed + epoch)."""
    images, labels = read_split(locate(), "train")
    x = images[: subset[0]].unsqueeze(1).float() / 255  # (N, 1, 28, 28)
    y = labels[: subset[0]]
    torch.manual_seed(seed)
    net = make_model(model)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    for epoch in range(epochs):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed + epoch))
        for start in range(0, len(y), batch_size):
            i = order[start:start + batch_size]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x[i]), y[i]).backward()
            opt.step()
    return net.state_dict()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One uninterrupted 2-process run through the command line (`python -m mparlib.ddp --nproc 2`)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    proc = subprocess.run([PY, "-m", "mparlib.ddp", "--nproc", "2", *CLI, "--out", str(out)], env=make_child_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc.stdout


# ------------------------------------------------------------------------------------------------ correctness

@pytest.mark.slow
def test_one_ddp_step_on_batch_halves_equals_one_full_batch_step():
    g = torch.Generator().manual_seed(1)
    x, y = torch.rand(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g)
    got = launch.launch(one_step, 2, args=(x, y), kwargs=dict(lr=0.5, seed=0), echo=False)

    torch.manual_seed(0)
    net = make_model("mlp")
    before = {k: v.clone() for k, v in net.state_dict().items()}
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
    assert max_diff(got, net.state_dict()) < 1e-6
    assert max_diff(got, before) > 1e-3  # the step really changed the parameters


@pytest.mark.slow
def test_two_process_run_equals_one_process_training(uninterrupted):
    out, stdout = uninterrupted
    ckpt = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == 2 and ckpt["world_size"] == 2
    assert ckpt["sampler"] == {"seed": 3, "epoch": 2, "shuffle": True, "drop_last": False, "num_replicas": 2}
    assert [h["epoch"] for h in ckpt["history"]] == [1, 2]
    assert stdout.count("epoch ") == 2 and "global batch 32 = 2 x 16" in stdout  # rank 0 alone logs
    assert max_diff(ckpt["model"], reference_training(**RUN)) < 1e-6
    plain = make_model("mlp")  # chapter 2's loader takes the checkpoint into a plain model
    assert load_checkpoint(plain, out / "checkpoint.pt")["epoch"] == 2
    assert max_diff(plain.state_dict(), ckpt["model"]) == 0


# ------------------------------------------------------------------------------------------------ checkpoints

@pytest.mark.slow
def test_resume_after_a_kill_reaches_the_uninterrupted_parameters(uninterrupted, tmp_path):
    cfg = DDPConfig(**RUN, out=str(tmp_path), crash_at=(2, 3))  # SIGKILL in the middle of epoch 2
    with pytest.raises(WorkerFailed, match="rank 0 was killed by signal SIGKILL"):
        launch.launch(train_worker, 2, args=(cfg,), echo=False)
    saved = torch.load(tmp_path / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert saved["epoch"] == 1  # epoch 1 survived; only epoch 2's progress is lost
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []

    result = launch.launch(train_worker, 2, args=(DDPConfig(**RUN, out=str(tmp_path), resume=True),), echo=False)
    assert [h["epoch"] for h in result["history"]] == [1, 2]
    assert max_diff(params_of(tmp_path / "checkpoint.pt"), params_of(uninterrupted[0] / "checkpoint.pt")) < 1e-7


@pytest.mark.slow
def test_resume_refuses_changed_settings(uninterrupted, tmp_path, capsys):
    out = uninterrupted[0]
    changed = [a if a != "0.2" else "0.3" for a in CLI]  # another learning rate
    assert ddp.main(["--nproc", "2", *changed, "--epochs", "3", "--resume", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "these differ: lr: checkpoint 0.2, now 0.3" in err


# ------------------------------------------------------------------------------------------------ torchrun

def _run_nodes(commands, tmp_path, deadline=180.0, after_failure=10.0):
    """Run torchrun "nodes" side by side; once one fails, stop the others ``after_failure`` seconds later.

    A node whose partner died waits in torchrun's exit barrier (5 minutes); the run as a whole must end in bounded
    time, so the test ends it. Returns ``(return codes, outputs)``.
    """
    logs = [open(tmp_path / f"node{i}.log", "w+") for i in range(len(commands))]
    nodes = [subprocess.Popen(c, env=make_child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
             for c, log in zip(commands, logs)]
    end, stop_at = time.monotonic() + deadline, None
    try:
        while any(n.poll() is None for n in nodes) and time.monotonic() < min(end, stop_at or end):
            if stop_at is None and any(n.poll() not in (None, 0) for n in nodes):
                stop_at = time.monotonic() + after_failure
            time.sleep(0.2)
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
                n.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return [n.returncode for n in nodes], outputs


@pytest.mark.slow
def test_two_torchrun_nodes_on_localhost_complete_a_run(tmp_path):
    port = rendezvous.free_port()
    out = tmp_path / "run"
    common = [TORCHRUN, "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
              f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=test-two-nodes", "-m", "mparlib.ddp",
              "--model", "mlp", "--epochs", "1", "--batch-size", "32", "--subset", "96,32", "--no-plot",
              "--out", str(out)]
    t = time.monotonic()
    codes, outputs = _run_nodes([common, common], tmp_path)
    assert codes == [0, 0], (time.monotonic() - t, outputs)
    assert not any("terminate called" in o for o in outputs), outputs
    assert sum("DDP: 2 processes" in o for o in outputs) == 1  # one global rank 0 across both "nodes"
    ckpt = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == 1 and ckpt["world_size"] == 2


# ------------------------------------------------------------------------------------------------ bad input

def test_missing_rendezvous_variables(monkeypatch, capsys):
    for k in rendezvous.RENDEZVOUS_VARS + ("TORCHELASTIC_RUN_ID",):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(LaunchError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set"):
        with rendezvous.process_group():
            pass
    assert ddp.main(["--model", "mlp"]) == 2
    err = capsys.readouterr().err
    assert "torchrun --nproc_per_node=2 -m mparlib.ddp" in err and "--nproc 2" in err


def test_nccl_needs_one_gpu_per_process(monkeypatch):
    monkeypatch.setattr(rendezvous, "num_gpus", lambda: 2)
    with pytest.raises(LaunchError, match="3 processes .* 2 GPU\\(s\\) .*--nproc 2"):
        rendezvous.check_gpus("nccl", 3)
    rendezvous.check_gpus("nccl", 2)
    rendezvous.check_gpus("gloo", 8)  # gloo runs processes on the CPU: any number
    monkeypatch.setattr(rendezvous, "num_gpus", lambda: 0)
    with pytest.raises(LaunchError, match="nccl backend needs CUDA GPUs"):
        launch.launch(one_step, 2, backend="nccl")


def test_world_size_leaving_a_rank_without_data(tmp_path, capsys):
    assert ddp.main(["--nproc", "4", "--model", "mlp", "--batch-size", "8", "--subset", "3,1",
                     "--out", str(tmp_path)]) == 2
    assert "has 3 example(s) but the run has 4 processes" in capsys.readouterr().err
    assert ddp.main(["--nproc", "2", "--model", "mlp", "--batch-size", "33", "--out", str(tmp_path)]) == 2
    assert "cannot be split evenly across 2 processes" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


def test_port_in_use(monkeypatch, capsys, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(LaunchError, match=f"Port {port} on 127.0.0.1 is already in use.*--port"):
            launch.launch(one_step, 2, port=port)
        monkeypatch.setenv("MASTER_PORT", str(port))
        monkeypatch.delenv("RANK", raising=False)
        assert ddp.main(["--nproc", "2", "--model", "mlp", "--subset", "64", "--batch-size", "16",
                         "--out", str(tmp_path)]) == 2
        assert f"Port {port} on 127.0.0.1 is already in use" in capsys.readouterr().err


def test_worker_defined_in_a_notebook_is_refused():
    def local_worker():
        return 1

    with pytest.raises(LaunchError, match="cannot find it"):
        launch.launch(local_worker, 2)
    main_worker = type(local_worker)(local_worker.__code__, {})
    main_worker.__module__, main_worker.__qualname__ = "__main__", "worker"
    with pytest.raises(LaunchError, match="notebook or script .*%%worker"):
        launch.launch(main_worker, 2)


@pytest.mark.slow
def test_out_folder_is_never_overwritten(uninterrupted, tmp_path, capsys):
    before = (uninterrupted[0] / "checkpoint.pt").read_bytes()
    assert ddp.main(["--nproc", "2", *CLI, "--out", str(uninterrupted[0])]) == 2
    assert "already exists and would be overwritten" in capsys.readouterr().err
    assert (uninterrupted[0] / "checkpoint.pt").read_bytes() == before
    assert ddp.main(["--nproc", "2", *CLI, "--resume", "--out", str(tmp_path)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_sync_batchnorm_on_cpu_is_refused(tmp_path, capsys):
    assert ddp.main(["--nproc", "2", "--sync-bn", "--backend", "gloo", "--out", str(tmp_path)]) == 2
    assert "SyncBatchNorm, which works only on GPUs" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ reliability

@pytest.mark.parametrize("option, value, match", [
    ("--lr", "nan", "lr=nan: use a positive, finite number"), ("--lr", "inf", "lr=inf"), ("--lr", "0", "lr=0.0"),
    ("--momentum", "-1", "momentum=-1.0"), ("--epochs", "0", "epochs=0"), ("--nproc", "0", "--nproc=0"),
])
def test_settings_that_cannot_work_are_refused_before_starting(tmp_path, capsys, option, value, match):
    argv = ["--nproc", "2", *CLI, "--out", str(tmp_path)]
    i = argv.index(option) if option in argv else None
    if i is None:
        argv += [option, value]
    else:
        argv[i + 1] = value
    assert ddp.main(argv) == 2
    assert match in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_too_many_processes_for_the_cpu_are_refused(tmp_path, capsys):
    many = 4 * (os.cpu_count() or 1) + 9  # more than the launcher's limit: 4 per core, at least 8
    assert ddp.main(["--nproc", str(many), *CLI, "--batch-size", str(many), "--subset", f"{many * 4},{many}",
                     "--out", str(tmp_path)]) == 2
    assert f"{many} processes on" in capsys.readouterr().err


@pytest.mark.slow
def test_a_diverging_run_stops_at_the_first_bad_epoch_and_keeps_the_last_good_checkpoint(tmp_path):
    launch.launch(train_worker, 2, args=(DDPConfig(**{**RUN, "epochs": 1}, out=str(tmp_path)),), echo=False)
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    for group in ckpt["optimizer"]["param_groups"]:  # resuming restores the optimizer: make its step size explode
        group["lr"] = 1e38
    torch.save(ckpt, tmp_path / "checkpoint.pt")
    patched = (tmp_path / "checkpoint.pt").read_bytes()
    cfg = DDPConfig(**{**RUN, "epochs": 2}, out=str(tmp_path), resume=True)
    with pytest.raises(TrainingDiverged, match=r"NaN or infinite at epoch 2, step \d+: .*checkpoint of epoch 1 was kept"):
        launch.launch(train_worker, 2, args=(cfg,), echo=False)
    assert (tmp_path / "checkpoint.pt").read_bytes() == patched  # epoch 1's checkpoint, not overwritten


@pytest.mark.slow
def test_a_run_that_diverges_at_once_says_no_checkpoint_was_written(tmp_path, capsys):
    argv = ["--nproc", "2", *CLI, "--out", str(tmp_path)]
    argv[argv.index("--lr") + 1] = "1e38"
    assert ddp.main(argv) == 2
    assert "no epoch had finished, so no checkpoint was written" in capsys.readouterr().err
    assert not (tmp_path / "checkpoint.pt").exists()


@pytest.mark.parametrize("content", [b"", b"not a checkpoint\n", b"PK\x03\x04truncated"])
def test_resume_from_a_damaged_or_foreign_file_is_a_clear_error(tmp_path, capsys, content):
    (tmp_path / "checkpoint.pt").write_bytes(content)
    assert ddp.main(["--nproc", "2", *CLI, "--resume", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "was not written by a mparlib.ddp training run (or is damaged)" in err and "Traceback" not in err
    assert (tmp_path / "checkpoint.pt").read_bytes() == content


def test_resume_from_another_programs_checkpoint_is_a_clear_error(tmp_path, capsys):
    torch.save({"model": {}, "epoch": 3}, tmp_path / "checkpoint.pt")
    assert ddp.main(["--nproc", "2", *CLI, "--resume", "--out", str(tmp_path)]) == 2
    assert "was not written by a mparlib.ddp training run" in capsys.readouterr().err


@pytest.mark.slow
def test_a_second_run_in_the_same_folder_is_refused_naming_the_first(tmp_path):
    busy = [*CLI, "--epochs", "200", "--subset", "6000,600"]  # long enough to be running when the second starts
    first = subprocess.Popen([PY, "-m", "mparlib.ddp", "--nproc", "2", *busy, "--out", str(tmp_path)],
                             env=make_child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, lock = time.monotonic() + 120, tmp_path / ".mparlib.lock"
        while not (lock.exists() and str(first.pid) in lock.read_text()):  # held from the start of the run
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0]
            time.sleep(0.1)
        second = subprocess.run([PY, "-m", "mparlib.ddp", "--nproc", "2", *CLI, "--out", str(tmp_path)],
                                env=make_child_env(), capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        assert "is in use by another run" in second.stderr and f"process {first.pid} " in second.stderr
        assert first.poll() is None  # the first run goes on undisturbed
    finally:
        first.kill()
        first.wait()


# ------------------------------------------------------------------------------------------------ width

def test_the_ddp_resnet18_takes_the_course_width(tmp_path, capsys):
    from mparlib import models

    torch.manual_seed(0)
    narrow = make_model("resnet18", width=16)
    assert [tuple(p.shape) for p in narrow.parameters()] == [
        tuple(p.shape) for p in models.resnet18(10, width=16).parameters()]
    assert DDPConfig().width == 64
    assert ddp.main(["--nproc", "2", "--model", "mlp", "--width", "16", "--out", str(tmp_path)]) == 2  # --width arrives
    assert "width=16 applies to model='resnet18' only" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="width=16 applies to model='resnet18' only"):
        make_model("mlp", width=16)
    with pytest.raises(ConfigError, match="width=16 applies to model='resnet18' only"):
        check_run(DDPConfig(**{**RUN, "width": 16}), 2, "gloo")
    with pytest.raises(ConfigError, match="width=0: use a positive int"):
        check_run(DDPConfig(model="resnet18", width=0), 2, "gloo")


@pytest.mark.slow
def test_resume_checks_the_width_and_reads_checkpoints_written_before_it_existed(uninterrupted, tmp_path):
    ckpt = torch.load(uninterrupted[0] / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert ckpt["config"]["width"] == 64
    torch.save({**ckpt, "config": {**ckpt["config"], "width": 16}}, tmp_path / "checkpoint.pt")
    cfg = DDPConfig(**RUN, out=str(tmp_path), resume=True)
    with pytest.raises(CheckpointError, match="these differ: width: checkpoint 16, now 64"):
        read_checkpoint(cfg)
    older = {k: v for k, v in ckpt["config"].items() if k != "width"}  # a run from before the width setting
    torch.save({**ckpt, "config": older}, tmp_path / "checkpoint.pt")
    assert read_checkpoint(cfg)["epoch"] == 2
    with pytest.raises(CheckpointError, match="width: checkpoint 64, now 16"):
        read_checkpoint(dataclasses.replace(cfg, width=16))


# ------------------------------------------------------------------------------------------------ one experiment

def test_one_definition_of_the_chapter_experiment_for_the_notebook_and_the_command_line():
    smoke, full = DDPConfig.for_profile("smoke", 2), DDPConfig.for_profile("full", 4)
    assert (smoke.model, smoke.width, smoke.epochs, smoke.subset) == ("resnet18", 8, 2, (9000, 1000))
    assert (smoke.batch_size, smoke.lr, smoke.momentum) == (32, 0.01, 0.9)  # 2 processes: 16 and 0.005 each
    assert (full.width, full.epochs, full.subset, full.batch_size, full.lr, full.momentum) == (64, 10, None, 1024, 0.4, 0)
    assert DDPConfig.for_profile("full", 1) == DDPConfig()  # the defaults are chapter 5's experiment on one process
    assert DDPConfig.for_profile("full", 2, batch_size=64, out="x").batch_size == 64  # a change is taken as given
    with pytest.raises(ConfigError, match="profile='tiny'"):
        DDPConfig.for_profile("tiny", 2)


# ------------------------------------------------------------------------------------------------ nothing left behind

@pytest.mark.slow
def test_main_leaves_no_handler_or_variable_behind_so_a_later_run_still_takes_the_lock(tmp_path, capsys):
    handler, environ = signal.getsignal(signal.SIGTERM), dict(os.environ)
    argv = ["--nproc", "2", "--model", "mlp", "--subset", "256,64", "--no-plot", "--out", str(tmp_path)]
    assert ddp.main([*argv, "--epochs", "1"]) == 0, capsys.readouterr()
    assert ddp.main([*argv, "--epochs", "2", "--resume"]) == 0, capsys.readouterr()
    assert signal.getsignal(signal.SIGTERM) is handler
    assert dict(os.environ) == environ
    ckpt = torch.load(tmp_path / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == 2 and (ckpt["config"]["batch_size"], ckpt["config"]["lr"]) == (512, 0.2)  # 2 x (256, 0.1)

    later = DDPConfig.for_profile("full", 2, model="mlp", subset=(256, 64), epochs=3, resume=True, plot=False,
                                  out=str(tmp_path))
    with lock_folder(tmp_path, what="--out"):  # another holder: the later run must be refused, not slip in
        with pytest.raises(OutputLocked, match="is in use by another run"):
            launch.launch(train_worker, 2, args=(later,), echo=False)
    assert torch.load(tmp_path / "checkpoint.pt", map_location="cpu", weights_only=True)["epoch"] == 2


def test_throughput_does_not_reseed_the_global_random_state():
    after = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        result = throughput.dataparallel("mlp", batch_size=4, steps=1, warmup=0, devices=[torch.device("cpu")])
        after.append(torch.rand(1).item())
        assert result["images_per_s"] > 0
    assert after[0] != after[1]  # the state still comes from the seed chosen here


@pytest.mark.slow
def test_ddp_throughput_comes_from_the_median_of_the_slowest_ranks_steps():
    r = launch.launch(throughput.ddp_worker, 2, args=("mlp",), kwargs=dict(per_rank_batch=4, steps=5, warmup=1),
                      echo=False, timeout=120)
    t = r["step_s"]
    assert t["repeats"] >= 5 and t["total"] >= 0.05  # measure's minimums: 5 steps and 50 ms
    assert r["images_per_s"] == pytest.approx(8 / t["median"])  # 2 ranks x 4 images per step
    low, high = r["images_per_s_min_max"]
    assert low == pytest.approx(8 / t["max"]) and high == pytest.approx(8 / t["min"]) and low <= r["images_per_s"] <= high
