"""Configs (issue 36, item 6): --config YAML/JSON files (flags override, unknown keys named),
every TrainConfig and SamplingParams field reachable, --resume refusing changed settings,
--version, and a parser that imports no jax (a fast --help)."""
import dataclasses
import json
import subprocess
import sys
import time

import pytest

from jaxrl_cache.app import cli, demo
from jaxrl_cache.app.options import RESUMABLE, DemoOptions
from jaxrl_cache.rl.train_config import TrainConfig
from jaxrl_cache.rollout.sampling import SamplingParams
from tests.test_demo import REPO, SMALL


def test_the_cli_parser_imports_no_jax():
    """`import jaxrl_cache.app.cli`, building the parser and `demo --help` import no jax
    (it took 2-5 s of a `--help`); --version answers from the package metadata."""
    code = ("import sys, contextlib, io\n"
            "import jaxrl_cache.app.cli as cli\n"
            "cli.build_parser()\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    for argv in (['--help'], ['demo', '--help'], ['--version']):\n"
            "        try:\n"
            "            cli.main(argv)\n"
            "        except SystemExit:\n"
            "            pass\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('jax', 'jaxlib', 'flax', 'optax', 'numpy')))\n")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert time.perf_counter() - start < 10  # a loose bound: a busy 2-core machine


def test_version(capsys):
    from importlib import metadata
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"jaxrl-cache {metadata.version('jaxrl-cache')}"


@pytest.fixture
def captured(monkeypatch):
    """cli.main runs no demo: the options and `given` it would run with are recorded."""
    calls = []

    def fake_run_demo(opts, *, given=None):
        calls.append((opts, given))
        raise ValueError("not run")

    monkeypatch.setattr(demo, "run_demo", fake_run_demo)
    return calls


def _run(argv, captured, capsys):
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip() == f"jaxrl-cache {argv[0]}: error: not run"
    return captured[-1]


YAML = """\
# a run's settings
group-size: 4
prompts_per_step: 2
lr: 3e-4            # PyYAML reads this as a string; the flag's type reads it as a number
kl_beta: 0.04
clip-eps: 0.3
epochs: 2
stop: ["\\n\\n", "Question:"]
answer_regex: '-?\\d+'
async: false
eval_greedy: true
remat: dots
compute_dtype: bfloat16
weight_decay: 0.01
sft_steps: null     # null: the default
"""


def test_config_files_yaml_and_json_flags_override(tmp_path, captured, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(YAML)
    task = REPO / "examples" / "tasks" / "add.jsonl"
    opts, given = _run(["grpo", "--config", str(config), "--dataset", str(task),
                        "--prompts-per-step", "4", "--eval-k", "3"], captured, capsys)
    assert (opts.group_size, opts.prompts_per_step) == (4, 4)
    assert (opts.lr, opts.kl_beta) == (3e-4, 0.04)
    assert (opts.clip_eps, opts.epochs) == (0.3, 2)
    assert opts.stop == ("\n\n", "Question:") and opts.answer_regex == r"-?\d+"
    assert (opts.async_rollouts, opts.eval_greedy, opts.eval_k) == (False, True, 3)
    assert (opts.remat, opts.compute_dtype, opts.weight_decay) == ("dots", "bfloat16", 0.01)
    assert opts.sft_steps is None and opts.steps == DemoOptions.steps
    assert given == {"group_size", "prompts_per_step", "lr", "kl_beta", "clip_eps", "epochs",
                     "stop", "answer_regex", "eval_greedy", "remat",
                     "compute_dtype", "weight_decay", "dataset", "eval_k"}
    train = demo.train_config(opts, async_rollouts=False)
    assert (train.kl_beta, train.clip_eps, train.epochs, train.remat) == (0.04, 0.3, 2, "dots")
    as_json = tmp_path / "run.json"
    as_json.write_text(json.dumps({"group_size": 6, "async": True, "max-policy-lag": 2,
                                   "top_p": 0.9, "top-k": 20}))
    opts, given = _run(["demo", "--config", str(as_json), "--group-size", "3"], captured,
                       capsys)
    assert (opts.group_size, opts.async_rollouts, opts.max_policy_lag) == (3, True, 2)
    assert (opts.top_p, opts.top_k) == (0.9, 20)
    assert given == {"group_size", "async_rollouts", "max_policy_lag", "top_p", "top_k"}


@pytest.mark.parametrize("text,suffix,message", [
    ("group_size: 4\nlearning_rate: 1\nbogus-key: 2\n", ".yaml",
     "unknown settings learning_rate, bogus-key (keys are the demo's flag names"),
    ("config: other.yaml\n", ".yml", "unknown setting config "),
    ("group_size: [4\n", ".yaml", "not valid YAML"),
    ('{"group_size": 4,}', ".json", "not valid JSON (line 1: "),
    ("- 1\n- 2\n", ".yaml", "expected a mapping of settings (flag: value), got list"),
    ("eval_greedy: 1\n", ".yaml", "eval_greedy is a switch: true or false, got 1"),
    ("group_size: [2, 3]\n", ".yaml", "group_size takes one value, got a list"),
    ("group_size: 1.5\n", ".yaml", "argument --group-size: expected a positive integer"),
    ("steps: true\n", ".yaml", "argument --steps: expected a positive integer, got 'true'"),
    ("group_size: 4\nsteps: 3\ngroup_size: 8\n", ".yaml",
     "not valid YAML (line 1: the key 'group_size' is given twice)"),
    ('{"steps": 3, "steps": 4}', ".json", "not valid JSON (the key 'steps' is given twice)"),
    ("group_size: 4\ngroup-size: 8\n", ".yaml", "group_size and group-size both set "
                                                 "--group-size"),
    ('{"async": true, "async_rollouts": false}', ".json", "both set --async"),
])
def test_bad_config_files_give_one_line(tmp_path, capsys, text, suffix, message):
    config = tmp_path / f"c{suffix}"
    config.write_text(text)
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--config", str(config), "--out", str(tmp_path / "run")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_every_train_config_and_sampling_field_is_a_setting():
    """Every TrainConfig and SamplingParams field is a DemoOptions field with a flag, but
    those the demo derives (named here with where they come from)."""
    derived = {"donate": "the loop (sync, one device)", "max_policy_lag": "--max-policy-lag",
               "n": "--group-size", "stop_token_ids": "the tokenizer's EOS ids",
               "max_new_tokens": "--max-new-tokens"}
    options = {f.name for f in dataclasses.fields(DemoOptions)}
    flags = {d for command in ("grpo", "demo")
             for d in cli.build_parser().commands[command].flags.dests()}
    for config in (TrainConfig, SamplingParams):
        for f in dataclasses.fields(config):
            if f.name not in derived:
                assert f.name in options and f.name in flags, f.name
    assert options - {"given"} <= flags | {"report_to"}
    opts = DemoOptions(clip_eps=0.1, dual_clip=3.0, is_cap=1.5, kl_beta=0.1, epochs=2,
                       remat="none", compute_dtype="bfloat16", logprob_chunk=64,
                       correction="decoupled", mini_batches=2, token_budget=512,
                       loss_type="grpo")
    train = demo.train_config(opts, async_rollouts=False)
    assert {f.name: getattr(train, f.name) for f in dataclasses.fields(train)} == dict(
        clip_eps=0.1, dual_clip=3.0, correction="decoupled", is_cap=1.5, max_policy_lag=None,
        loss_type="grpo", kl_beta=0.1, mini_batches=2, epochs=2, token_budget=512,
        remat="none", compute_dtype="bfloat16", logprob_chunk=64, donate=True,
        epsilon_high=None, importance_sampling_level="token", entropy_coef=0.0,
        mask_truncated_completions=False)
    for bad, message in ((dict(top_p=0.0), "--top-p: top_p must be"),
                         (dict(clip_eps=-1.0), "--clip-eps: clip_eps must be"),
                         (dict(stop=("",)), "--stop: stop[0] is an empty string"),
                         (dict(adam_b2=1.0), "--adam-b2 must be a number in [0.0, 1.0)"),
                         (dict(kl_beta=0.1, top_k=5), "--kl-beta with --top-k/--top-p")):
        with pytest.raises(ValueError, match="^" + message.replace("[", r"\[")
                           .replace("(", r"\(").replace(")", r"\)")):
            DemoOptions(**bad)


@pytest.mark.parametrize("source", ["flag", "config"])
def test_page_size_is_a_checked_setting(tmp_path, captured, capsys, source):
    """--page-size (issue 62; the demo's pages were a hard-coded 8): a flag and a --config
    key, the default 8, a power of two up to CacheConfig's 65536, refused in one line before
    any work otherwise; it reaches the demo's options."""
    def argv(value):
        if source == "flag":
            return ["demo", "--page-size", str(value), "--out", str(tmp_path / "run")]
        config = tmp_path / "c.yaml"
        config.write_text(f"page_size: {value}\n")
        return ["demo", "--config", str(config), "--out", str(tmp_path / "run")]

    opts, given = _run(argv(16), captured, capsys)
    assert opts.page_size == 16 and "page_size" in given
    opts, given = _run(["demo", "--out", str(tmp_path / "run")], captured, capsys)
    assert opts.page_size == DemoOptions.page_size == 8 and "page_size" not in given
    for bad, message in ((12, "argument --page-size: expected a power of two, got 12"),
                         (0, "argument --page-size: expected a power of two, got 0"),
                         ("x", "argument --page-size: expected a power of two, got 'x'"),
                         (2**17, "--page-size must be a power of two in [1, 65536], got "
                                 "131072")):
        try:
            code = cli.main(argv(bad))
        except SystemExit as e:
            code = e.code
        assert code == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err
    assert not (tmp_path / "run").exists()
    for bad in (3, 0, -8, 2**17, True, 8.0, "8"):
        with pytest.raises(ValueError, match=r"^--page-size must be a power of two in "
                                             r"\[1, 65536\], got "):
            DemoOptions(page_size=bad)


def test_page_size_sizes_the_kv_pool(monkeypatch):
    """The job's checks and the pool count pages of --page-size tokens."""
    monkeypatch.setattr(demo, "available_bytes", lambda: 2**40)
    config = demo.builtin_model_config(demo.char_tokenizer().vocab_size)
    small, large = (DemoOptions(page_size=p, prompts_per_step=1, rollout_calls=1,
                                group_size=2, eval_prompts=1, kv_pages=None) for p in (8, 64))
    assert demo._pool_bytes(config, 1, 64) == 8 * demo._pool_bytes(config, 1, 8)
    assert demo._job_kv_pages(dataclasses.replace(small, eval_prompts=200), config, 129) \
        == 200 * 16 + 1
    assert demo._job_kv_pages(dataclasses.replace(large, eval_prompts=200), config, 129) \
        == 200 * 2 + 1
    with pytest.raises(ValueError, match="needs 2 KV pages of 64 tokens; use --kv-pages 3"):
        demo._check_job(dataclasses.replace(large, kv_pages=2), config, 129, None)


def _saved_run(out, **options):
    out.mkdir(parents=True)
    saved = dataclasses.asdict(DemoOptions(out=str(out), **options))
    (out / "run.json").write_text(json.dumps({"options": saved}))
    (out / "metrics.jsonl").write_text("")


def test_resume_refuses_changed_settings_in_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    _saved_run(out, **SMALL)
    config = tmp_path / "c.yaml"
    config.write_text("group_size: 4\ntemperature: 0.5\n")
    for argv, differences in [
            (["--lr", "0.01"], "--lr 0.01 (the run has None)"),
            (["--config", str(config), "--group-size", "2"], "--temperature 0.5 (the run has "
                                                             "1.0)"),
            (["--config", str(config), "--kl-beta", "0.1"],
             "--group-size 4 (the run has 2); --kl-beta 0.1 (the run has 0.0); --temperature "
             "0.5 (the run has 1.0)"),
            (["--group-size", "8"], "--group-size 8 (the run has 2)")]:  # 8 is the default
        assert cli.main(["demo", "--out", str(out), "--resume", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err, err
        assert err == (f"jaxrl-cache demo: error: --resume: {out} was started with other "
                       f"settings: {differences}; only --steps, --checkpoint-every, "
                       f"--eval-every, --report-to and --no-completions-log may change (or "
                       f"start over with --overwrite)"), err
    assert set(RESUMABLE) == {"steps", "checkpoint_every", "eval_every", "report_to",
                              "completions_log"}


def test_resume_keeps_the_run_settings_and_takes_the_resumable_ones(tmp_path):
    out = tmp_path / "run"
    _saved_run(out, **dict(SMALL, eval_every=5, lr=0.01))
    asked = DemoOptions(out=str(out), resume=True, steps=9, eval_every=2, group_size=2,
                        lr=0.01, checkpoint_every=1)
    opts, *_ = demo._prepare(asked, given={"out", "resume", "steps", "eval_every",
                                           "group_size", "lr", "checkpoint_every"})
    assert (opts.steps, opts.eval_every, opts.checkpoint_every) == (9, 2, 1)  # given: taken
    assert (opts.sft_batch, opts.prompts_per_step, opts.lr) == (4, 4, 0.01)  # the run's
    opts, *_ = demo._prepare(DemoOptions(out=str(out), resume=True), given={"out", "resume"})
    assert (opts.eval_every, opts.checkpoint_every, opts.steps) == (5, 2, 120)


def test_the_cli_caps_glibc_malloc_arenas(monkeypatch):
    """mallopt(M_ARENA_MAX, MALLOC_ARENAS) unless the user set MALLOC_ARENA_MAX (then glibc
    already follows it); a libc without mallopt is left alone."""
    calls = []

    class Libc:
        def mallopt(self, option, value):
            calls.append((option.value, value.value))

    monkeypatch.setattr(cli.ctypes, "CDLL", lambda name: Libc())
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    cli.limit_malloc_arenas()
    assert calls == [(-8, cli.MALLOC_ARENAS)]
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    cli.limit_malloc_arenas()
    assert len(calls) == 1
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    monkeypatch.setattr(cli.ctypes, "CDLL", lambda name: object())  # no mallopt
    cli.limit_malloc_arenas()


def test_config_reading_uses_argparse_public_api_only():
    """A parser built with cli._Parser records its long options (Flags), groups included;
    config_argv turns a file into arguments argparse parses as typed on the command line;
    given_names finds the explicitly set dests without changing the parser (its defaults,
    a repeatable flag's and a str default converted by `type` included)."""
    from jaxrl_cache.app import config_file
    parser = cli._Parser(prog="p")
    parser.add_argument("--count", type=int, default="7")  # a str default: `type` converts it
    group = parser.add_argument_group("g")
    group.add_argument("--tag", dest="tags", action="append")
    group.add_argument("--fast", action="store_true")
    group.add_argument("--no-log", dest="log", action="store_false")
    assert {k: (f.option, f.dest, f.kind) for k, f in parser.flags.by_key.items()} == {
        "count": ("--count", "count", "value"), "tag": ("--tag", "tags", "list"),
        "tags": ("--tag", "tags", "list"), "fast": ("--fast", "fast", "switch"),
        "no_log": ("--no-log", "log", "switch"), "log": ("--no-log", "log", "switch")}
    before = vars(parser.parse_args([]))
    assert before == dict(count=7, tags=None, fast=False, log=True)
    assert config_file.given_names(parser, ["--tag", "a", "--tag=b", "--no-log"]) == {
        "tags", "log"}
    assert config_file.given_names(parser, []) == set()
    assert vars(parser.parse_args([])) == before  # the parser is unchanged
    assert vars(parser.parse_args(["--tag", "a", "--tag=b"]))["tags"] == ["a", "b"]
    with pytest.raises(TypeError, match="--many: a config file cannot set action='count'"):
        parser.add_argument("--many", action="count")
