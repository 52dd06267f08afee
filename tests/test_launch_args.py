"""The launch command line refuses nonsense before any engine starts: each bad value exits with
status 2 and a message naming the flag and its valid range. Also: the cluster's dashboard listens
on loopback only. CPU only, no engine; a few seconds."""

import math
import sys
import types
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))
import common  # noqa: E402  launch/common.py, as the launch scripts import it


def _error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        common.parse_args("doc", "runs/x", argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, message", [
    (["--prompts", "0"], "--prompts must be >= 1, got 0"),
    (["--epochs", "0"], "--epochs must be >= 1, got 0"),
    (["--micro-batch-tokens", "0"], "--micro-batch-tokens must be >= 1, got 0"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--steps", "-3"], "--steps must be >= 1, got -3"),
    (["--group-size", "0"], "--group-size must be >= 2, got 0"),
    (["--group-size", "1"], "--group-size must be >= 2, got 1"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
    (["--optim-steps", "-1"], "--optim-steps must be >= 1, got -1"),
    (["--generators", "0"], "--generators must be >= 1, got 0"),
    (["--save-every", "-1"], "--save-every must be >= 0, got -1"),
    (["--eval-every", "-2"], "--eval-every must be >= 0, got -2"),
    (["--max-staleness", "-1"], "--max-staleness must be >= 0, got -1"),
    (["--ray", "-1"], "--ray must be >= 0, got -1"),
    (["--activation-checkpointing", "-2"], "--activation-checkpointing takes a number of layers >= 0, got -2"),
    (["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
    (["--lr", "-0.5"], "--lr must be a finite number > 0, got -0.5"),
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--kv-cache-gib", "0"], "--kv-cache-gib must be > 0, got 0.0"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1], got 1.5"),
    (["--activation-memory-budget", "0"], "--activation-memory-budget must be in (0, 1], got 0.0"),
    (["--eval-samples", "2", "--eval-k", "4"], "--eval-k 4 must be <= --eval-samples 2"),
    (["--eval-every", "5"], "--eval-every needs held-out rows: set --eval-size N"),
    (["--lora-alpha", "32"], "--lora-alpha / --lora-also-train shape LoRA adapters: give --lora-rank R"),
    (["--lora-also-train", "embed_tokens"], "--lora-alpha / --lora-also-train shape LoRA adapters"),
    (["--lora-rank", "-4"], "--lora-rank must be >= 0, got -4"),
    (["--lora-rank", "8", "--lora-alpha", "0"], "--lora-alpha must be a finite number > 0, got 0.0"),
    (["--lora-rank", "8", "--lora-alpha", "-16"], "--lora-alpha must be a finite number > 0, got -16.0"),
    (["--kl-coef", "-0.01"], "--kl-coef must be a finite number >= 0, got -0.01"),
    (["--kl-coef", "nan"], "--kl-coef must be a finite number >= 0, got nan"),
    (["--kl-estimator", "k1"], "--kl-estimator / --reference-offload shape the reference policy's KL: give --kl-coef"),
    (["--reference-offload"], "--kl-estimator / --reference-offload shape the reference policy's KL"),
    (["--env", "lookup", "--task", "add"], "--env lookup makes its own prompts and rewards: drop --task / --data"),
    (["--env", "lookup", "--eval-size", "8", "--eval-every", "5"],
     "--eval-every evaluates one turn of --task's held-out rows, not --env lookup's episodes"),
    (["--env", "feedback", "--overlong-filter"], "--overlong-filter / --overlong-cache judge one turn cut at"),
    (["--env", "lookup", "--overlong-cache", "1"], "--env lookup's turns are sampled at their own lengths"),
    (["--max-tokens", "8", "--overlong-cache", "9"], "--overlong-cache must be in [0, --max-tokens=8], got 9"),
    (["--max-tokens", "256"], "--max-tokens 256 must be < --max-model-len 256 (the prompt needs room)"),
    (["--task", "gsm9k"], "argument --task: invalid choice: 'gsm9k'"),
    (["--backends", "tensorbord"], "--backends: unknown tensorbord; a comma list of tensorboard,wandb,mlflow"),
    (["--compilation-config", "mode=0"], "argument --compilation-config: not JSON"),
    (["--compilation-config", "[0]"], "'[0]' is JSON but not an object"),
    (["--engine-kwargs", "attention_backend=TRITON_ATTN"], "argument --engine-kwargs: not JSON"),
    (["--gen-resources", "{CPU: 1}"], "argument --gen-resources: not JSON"),
    (["--gen-resources", '["CPU"]'], "argument --gen-resources: '[\"CPU\"]' is JSON but not an object"),
])
def test_nonsense_values_fail_at_parse_time(argv, message, capsys):
    assert message in _error(argv, capsys)


def test_a_flag_of_the_other_loop_is_refused(capsys):
    """(co-located) and (async) flags given to the other loop: refused, not ignored (--ray in the async
    loop started every rank's own server on one queue and failed late)."""
    for argv, async_loop, message in [(["--role", "server"], False, "--role is async only (launch/async.py)"),
                                      (["--generators", "4"], False, "--generators is async only (launch/async.py)"),
                                      (["--ray", "2"], True, "--ray is co-located only (launch/colocated.py)"),
                                      (["--no-sync"], True, "--no-sync is co-located only (launch/colocated.py)")]:
        with pytest.raises(SystemExit) as e:
            common.parse_args("doc", "runs/x", argv, async_loop=async_loop)
        assert e.value.code == 2 and capsys.readouterr().err.strip() == f"error: {message}"
    assert common.parse_args("doc", "runs/x", ["--role", "both", "--generators", "1"]).generators == 1
    assert common.parse_args("doc", "runs/x", ["--generators", "4"], async_loop=True).generators == 4


def test_a_flag_this_run_would_not_read_is_refused(capsys, tmp_path):
    """Given where nothing reads it (they were accepted and silently ignored); where they are read, kept."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for argv, async_loop, message in [
            (["--prompt-key", "q"], False, "--prompt-key is not read without --data (fields of its rows): give "
             "--data or drop it"),
            (["--system-prompt", "be brief"], False, "--system-prompt is not read unless the model's chat template "
             "renders the prompts (--model, and a --task but the toys copy / succ / add): drop it"),
            (["--task", "arith", "--model", str(model), "--no-chat-template", "--thinking"], False, "--thinking is "
             "not read unless the model's chat template renders the prompts"),
            (["--no-chat-template"], False, "--no-chat-template is not read unless the model's chat template would "
             "render the prompts"),
            (["--refill-rounds", "2"], False, "--refill-rounds is not read without --dynamic-sampling: give "
             "--dynamic-sampling or drop it"),
            (["--eval-samples", "8", "--eval-k", "2"], False, "--eval-samples / --eval-k are not read without "
             "--eval-every N: give --eval-every N or drop them"),
            (["--env", "lookup", "--eval-size", "4"], False, "--eval-size is not read with --env lookup, which makes "
             "its own prompts: drop it"),
            (["--role", "trainer", "--generators", "2"], True, "--generators is not read by --role trainer (the "
             "--role server job generates): drop it")]:
        with pytest.raises(SystemExit) as e:
            common.parse_args("doc", "runs/x", argv, async_loop=async_loop)
        assert e.value.code == 2 and capsys.readouterr().err.strip().startswith(f"error: {message}"), argv
    a = common.parse_args("doc", "runs/x", ["--task", "arith", "--model", str(model), "--system-prompt", "x",
                                            "--dynamic-sampling", "--refill-rounds", "2"])
    assert (a.system_prompt, a.refill_rounds) == ("x", 2)


def test_a_backend_without_its_package_is_refused(monkeypatch, capsys):
    """--backends wandb without wandb installed: refused at parse time, not by the Tracker after the model loaded."""
    real = common.importlib.util.find_spec
    monkeypatch.setattr(common.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    message = _error(["--backends", "tensorboard,wandb"], capsys)
    assert message.startswith("error: --backends wandb needs its package: pip install wandb")
    assert common.parse_args("doc", "runs/x", ["--backends", "tensorboard"]).backends == "tensorboard"
    assert common.parse_args("doc", "runs/x", ["--backends", ""]).backends == ""


def test_defaults_and_good_values_parse(tmp_path):
    args = common.parse_args("doc", "runs/x", [])
    assert (args.steps, args.prompts, args.group_size, args.task, args.eval_every) == (60, 32, 8, "succ", 0)
    (tmp_path / "config.json").write_text("{}")
    args = common.parse_args("doc", "runs/x", ["--task", "gsm8k", "--data", "d.jsonl", "--eval-size", "8", "--model",
                                               str(tmp_path), "--eval-every", "2", "--no-thinking", "--max-tokens", "8"])
    assert (args.task, args.eval_size, args.thinking) == ("gsm8k", 8, False)
    ckpt = [common.trainer_config(common.parse_args("doc", "runs/x", argv)).activation_checkpointing
            for argv in ([], ["--activation-checkpointing"], ["--activation-checkpointing", "12"])]
    assert ckpt == [None, True, 12]
    budgets = [common.trainer_config(common.parse_args("doc", "runs/x", argv)).activation_memory_budget
               for argv in ([], ["--activation-memory-budget", "0.6"])]
    assert budgets == [None, 0.6]
    args = common.parse_args("doc", "runs/x", ["--compilation-config", '{"mode": 0}'])
    assert common.llm_kwargs(args)["compilation_config"] == {"mode": 0}
    args = common.parse_args("doc", "runs/x", ["--engine-kwargs", '{"attention_backend": "TRITON_ATTN", "max_num_seqs": 8}'])
    kw = common.llm_kwargs(args)                     # the user's arguments win over the launch's own
    assert (kw["attention_backend"], kw["max_num_seqs"], kw["max_model_len"]) == ("TRITON_ATTN", 8, 256)


@pytest.mark.parametrize("engine_kwargs, seqs, per_call", [
    ([], 256, 32), (["--engine-kwargs", '{"max_num_seqs": 32}'], 32, 4)])
def test_the_async_generators_keep_a_max_num_seqs_given(monkeypatch, engine_kwargs, seqs, per_call):
    """The async launch runs 256 sequences an engine unless --engine-kwargs sets max_num_seqs (it was
    overwritten with 256), and leases as many prompts at a time as fill them (group size 8)."""
    import actors.server
    got = {}

    def server(*a, **kw):
        got.update(kw)
        raise KeyboardInterrupt
    monkeypatch.setattr(actors.server, "RolloutServer", server)
    monkeypatch.setattr(common, "model_path", lambda args: "model")
    args = common.parse_args("doc", "runs/x", ["--role", "server", *engine_kwargs], async_loop=True)
    with pytest.raises(KeyboardInterrupt):
        common.start_server(args, common.make_task(args))
    assert (got["llm_kwargs"]["max_num_seqs"], got["prompts_per_call"]) == (seqs, per_call)


def test_eval_schedule():
    args = common.parse_args("doc", "runs/x", ["--steps", "7", "--eval-every", "3", "--eval-size", "4"])
    assert [s for s in range(1, 8) if common.eval_due(args, s)] == [3, 6, 7]
    args = common.parse_args("doc", "runs/x", ["--steps", "7"])
    assert not any(common.eval_due(args, s) for s in range(1, 8))


def test_cluster_dashboard_is_loopback_only():
    cfg = yaml.safe_load((ROOT / "launch" / "cluster.yaml").read_text())
    head = " ".join(cfg["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in (ROOT / "launch" / "cluster.yaml").read_text()


def test_task_and_env_names_are_minirls():
    """The launcher names the tasks and environments itself (so --help imports nothing heavy): the same."""
    from minirl.recipes.envs import ENVS
    from minirl.recipes.tracking import BACKENDS
    from minirl.recipes.tasks import DATA_TASKS, GENERATED, TASKS
    assert set(common.TASK_NAMES) == {*TASKS, *GENERATED, *DATA_TASKS}
    assert set(common.ENV_NAMES) == set(ENVS)
    assert common.BACKEND_NAMES == BACKENDS


def test_resume_keeps_the_runs_settings(tmp_path, capsys):
    """--resume: flags not given take the run's saved values (--save-every among them); those that
    define the run (seed, prompts, ...) must match when given; the others may change (--steps)."""
    run = str(tmp_path / "run")
    first = common.parse_args("doc", "runs/x", ["--run-dir", run, "--save-every", "3", "--seed", "7", "--lr", "0.01"])
    common.prepare(first)                                            # records RUN_DIR/args.json
    args = common.parse_args("doc", "runs/x", ["--run-dir", run, "--resume"])
    assert (args.save_every, args.seed, args.lr, args.steps, args.resume) == (3, 7, 0.01, 60, True)
    args = common.parse_args("doc", "runs/x", ["--run-dir", run, "--resume", "--steps", "90", "--save-every", "5",
                                               "--seed", "7"])
    assert (args.steps, args.save_every, args.seed) == (90, 5, 7)
    message = _error(["--run-dir", run, "--resume", "--seed", "0"], capsys)
    assert message.startswith("error: --resume: --seed 0 differs from the run's 7") and "another --run-dir" in message
    lora = str(tmp_path / "lora")                  # LoRA's alpha defaulted to 2 x rank: naming it resumes
    common.prepare(common.parse_args("doc", "runs/x", ["--run-dir", lora, "--lora-rank", "16"]))
    args = common.parse_args("doc", "runs/x", ["--run-dir", lora, "--resume", "--lora-alpha", "32"])
    assert (args.lora_rank, args.lora_alpha, common.trainer_config(args).lora.alpha) == (16, 32.0, 32.0)
    assert _error(["--run-dir", lora, "--resume", "--lora-alpha", "8"], capsys).startswith(
        "error: --resume: --lora-alpha 8.0 differs from the run's 32.0")


class _Trainer:
    """What train_step asks of a Trainer, with fixed numbers."""
    policy_version, config, device = 3, types.SimpleNamespace(reference=False), "cpu"
    rebalance = staticmethod(list)

    def forward_backward(self, rollouts, loss_fn):
        return dict.fromkeys(("loss", "clip_frac", "approx_kl", "entropy", "ratio", "tokens"), 0.0)

    def optim_step(self):
        return {"grad_norm": 0.0}


def test_staleness_metrics_only_in_the_async_loop():
    from minirl.data import Rollout, RolloutBatch
    batch = lambda: [RolloutBatch([Rollout([1], [2], [-1.0], reward=float(i), policy_version=2) for i in range(2)])]
    args = common.parse_args("doc", "runs/x", [])
    colocated = common.train_step(_Trainer(), batch(), args, 1)
    asynchronous = common.train_step(_Trainer(), batch(), args, 1, max_staleness=1)
    assert not [k for k in colocated if "staleness" in k] and asynchronous["staleness"] == 1
    assert sorted(set(asynchronous) - set(colocated)) == [
        "async/rollouts_spanning_versions", "async/staleness_0", "async/staleness_1", "async/staleness_max",
        "async/staleness_mean", "async/staleness_over", "staleness"]
    assert asynchronous["async/staleness_1"] == 2


def test_episode_metrics_by_hand():
    from minirl.data import Rollout, RolloutBatch
    r = lambda reason, **info: Rollout([1], [2], [-1.0], reward=0.0, finish_reason=reason, info=info)
    rollouts = [r("stop", turns=1, episode_s=1.0, tool_calls=2, tool_s=0.5),
                r("error", turns=2, episode_s=3.0, tool_calls=1, tool_s=0.5, tool_timeouts=1,
                  error="raised ToolTimeout: tool 'f' ran past 0.5 s in ep 1"),
                r("max_turns", turns=3, episode_s=2.0), r("error", turns=2, episode_s=2.0, error="raised KeyError: 'x'")]
    m = common.episode_metrics(rollouts)
    assert m == {"episode/turns": 2.0, "episode/turns_max": 3, "episode/seconds": 2.0, "episode/tool_calls": 0.75,
                 "episode/tool_s": 0.25, "episode/finish_stop": 0.25,
                 "episode/finish_length": 0.0, "episode/finish_max_turns": 0.25, "episode/finish_max_model_len": 0.0,
                 "episode/finish_error": 0.5, "episode/timeouts": 0.25}
    batch = lambda: [RolloutBatch(rollouts[:2]), RolloutBatch(rollouts[2:])]
    single = common.train_step(_Trainer(), batch(), common.parse_args("doc", "runs/x", []), 1)
    multi = common.train_step(_Trainer(), batch(), common.parse_args("doc", "runs/x", ["--env", "lookup"]), 1)
    assert not [k for k in single if k.startswith("episode/")] and multi["episode/turns"] == 2.0


def test_an_error_minirl_raised_is_one_line_and_torchs_keeps_its_trace():
    """message_of: a ValueError raised in minirl's lines is its message on one line; torch's
    out-of-memory error raised by a tensor call in the same lines is not minirl's (None: the trace stays)."""
    import torch
    src = "def boom(e):\n    raise e\n"
    space: dict = {}
    exec(compile(src, "/somewhere/minirl/fake.py", "exec"), space)
    for err, want in [(ValueError("bad input:\n use --fix"), "bad input: use --fix"),
                      (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 96.00 MiB"), None)]:
        try:
            space["boom"](err)
        except Exception as e:
            assert common.message_of(e) == want


def test_evaluation_over_ranks_is_the_mean_over_every_held_out_row():
    """Each rank evaluates its share of the held-out rows (5 over 2 ranks: 3 and 2) and log() takes the
    mean over the ranks: that mean is the one of the whole held-out set (pass@1 3/5, not (3/3 + 0/2) / 2),
    and eval/prompts counts every row (5, not 2.5)."""
    out = lambda n: types.SimpleNamespace(text="x", token_ids=[1, 2], finish_reason="stop")
    llm = types.SimpleNamespace(generate=lambda prompts, params, use_tqdm: [
        types.SimpleNamespace(outputs=[out(i) for i in range(params.n)]) for _ in prompts])
    task = types.SimpleNamespace(held_out=[(f"p{i}", str(i)) for i in range(5)],
                                 reward=lambda prompt, completion, answer: float(int(answer) % 2 == 0))
    args = common.parse_args("doc", "runs/x", ["--eval-size", "5", "--eval-every", "1"])
    whole = common.evaluate(llm, task, args)
    ranks = [common.evaluate(llm, task, args, rank, 2) for rank in range(2)]
    logged = {k: sum(m[k] for m in ranks) / 2 for k in whole}          # what tracked's log() writes
    assert (whole["eval/pass@1"], whole["eval/prompts"]) == (0.6, 5)
    for k in whole.keys() - {"eval/time"}:
        assert logged[k] == pytest.approx(whole[k]), k


def _rank_main(rank: int, world: int, port: int, fn, args: tuple, out) -> None:
    """One spawned rank of a gloo group: out[rank] = fn(rank, *args)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out[rank] = fn(rank, *args)
    dist.destroy_process_group()


def _on_ranks(world: int, fn, *args) -> dict:
    """{rank: fn(rank, *args)} from `world` spawned processes in one gloo group."""
    import torch.multiprocessing as mp
    from minirl.distributed import free_port
    out = mp.get_context("spawn").Manager().dict()
    mp.spawn(_rank_main, args=(world, free_port(), fn, args, out), nprocs=world, join=True)
    return dict(out)


def _track(rank: int, run: str, start: int, records: list) -> str:
    """One rank of the tracked() tests: log this rank's metrics of each step through tracked()."""
    args = common.parse_args("doc", "runs/x", ["--run-dir", run, "--backends", "", "--steps", "2"])
    trainer = types.SimpleNamespace(device="cpu", rank=types.SimpleNamespace(rank=rank))
    with common.tracked(args, trainer, start) as log:
        for step, metrics in records:
            log(step, metrics[rank])
    return "done"


def _tracked(tmp_path, world: int, start: int, records: list) -> list[dict]:
    """metrics.jsonl after `world` spawned ranks logged records [(step, [metrics of each rank])] from `start`."""
    from minirl.recipes.tracking import read_metrics
    assert _on_ranks(world, _track, str(tmp_path), start, records) == dict.fromkeys(range(world), "done")
    return read_metrics(tmp_path / "metrics.jsonl")


def test_a_maximum_over_ranks_is_logged_as_the_maximum(tmp_path):
    """log() averages the ranks' metrics, but a maximum (reward/max, episode/turns_max) is the largest
    of any rank's: a rollout rewarded 1 on one rank of two is a reward/max of 1, not 0.5."""
    ranks = [{"reward/mean": 0.5, "reward/max": 1.0, "episode/turns_max": 3},
             {"reward/mean": 0.1, "reward/max": 0.0, "episode/turns_max": 1}]
    (record,) = _tracked(tmp_path, 2, 1, [(1, ranks)])
    assert record["reward/mean"] == pytest.approx(0.3)
    assert (record["reward/max"], record["episode/turns_max"]) == (1.0, 3.0)


def _pooled(rank: int, parts: list) -> float:
    """One rank of the pooled_std test."""
    import torch
    return common.pooled_std(torch.tensor(parts[rank]), "cpu")


def test_adv_std_over_ranks_is_the_std_of_every_ranks_advantages():
    """adv/std of two ranks holding [-1, 1] and [-3, 3, 0]: each rank logs the std of all five values
    together (sqrt(20 / 4) = 2.236), not the mean of the two ranks' stds ((1.414 + 3) / 2 = 2.207)."""
    import torch
    out = _on_ranks(2, _pooled, [[-1.0, 1.0], [-3.0, 3.0, 0.0]])
    assert out[0] == out[1] == pytest.approx(5 ** 0.5)
    assert common.pooled_std(torch.tensor([1.0, 2.0, 4.0]), "cpu") == pytest.approx(torch.tensor([1.0, 2.0, 4.0]).std())
    assert math.isnan(common.pooled_std(torch.tensor([1.0]), "cpu"))       # as torch.std of one value


def test_a_fresh_run_drops_an_earlier_runs_records_its_step_0_evaluation_too(tmp_path):
    """A new run in a run directory that held another's metrics.jsonl: none of the earlier records stay
    (its step-0 evaluation stayed: step 0 twice, and the earlier pass@1 printed as this run's first);
    a resumed run keeps those before its first step."""
    earlier = [(0, [{"eval/pass@1": 0.9}]), (1, [{"reward/mean": 0.9}]), (2, [{"reward/mean": 0.9}])]
    _tracked(tmp_path, 1, 1, earlier)
    records = _tracked(tmp_path, 1, 1, [(0, [{"eval/pass@1": 0.1}]), (1, [{"reward/mean": 0.2, "tokens": 2**24 + 1}])])
    assert [r["step"] for r in records] == [0, 1]
    # logged as given: 0.2, not float32's 0.20000000298; a count past 2**24 exact
    assert (records[0]["eval/pass@1"], records[1]["reward/mean"], records[1]["tokens"]) == (0.1, 0.2, 2**24 + 1)
    records = _tracked(tmp_path, 1, 2, [(2, [{"reward/mean": 0.3}])])
    assert [r["step"] for r in records] == [0, 1, 2]


def test_fewer_held_out_rows_than_ranks_is_refused(monkeypatch, capsys):
    """(co-located) each rank evaluates its share of the held-out rows: fewer rows than ranks (--ray N or
    torchrun's WORLD_SIZE) is refused at parse time, not at the first evaluation after the models loaded."""
    message = _error(["--ray", "2", "--eval-size", "1", "--eval-every", "1"], capsys)
    assert message == "error: --eval-size 1 gives some of the 2 ranks no held-out rows: set --eval-size >= 2"
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert _error(["--eval-size", "3", "--eval-every", "1"], capsys).endswith("set --eval-size >= 4")
    assert common.parse_args("doc", "runs/x", ["--eval-size", "4", "--eval-every", "1"]).eval_size == 4
    assert common.parse_args("doc", "runs/x", ["--eval-size", "3"]).eval_size == 3      # no evaluation
