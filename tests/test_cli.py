"""The CLI: `--help` answers without importing torch, every option says what it does and shows its default,
and the defaults and help of calibrate's flags are CalibrationConfig's."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_model, new_router

from tide_hf.cli import OWN_FLAGS, SET_FIELDS, build_parser
from tide_hf.settings import SAMPLING_FIELDS, CalibrationConfig

HELP_LINES, HELP_COLUMNS = 60, 100  # every help page fits a screen of this many lines, at this terminal width


def subparsers(parser: argparse.ArgumentParser | None = None) -> dict[str, argparse.ArgumentParser]:
    """Every command's parser by its name, bench's sections as `bench NAME` too."""
    parser = build_parser() if parser is None else parser
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found = {}
    for name, sub in action.choices.items():
        found[name] = sub
        if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
            found.update({f"{name} {section}": p for section, p in subparsers(sub).items()})
    return found


def documented_command_lines() -> list[tuple[str, list[str]]]:
    """(file, arguments) of every `tide-hf ...` line of a bash block in the README, the docs (but the changelog and
    the results page, which quote commands as they were run) and benchmarks/README.md."""
    root = Path(__file__).resolve().parent.parent
    files = [root / "README.md", root / "benchmarks" / "README.md", *sorted((root / "docs").rglob("*.md"))]
    found = []
    for path in files:
        if path.name in ("changelog.md", "results.md"):
            continue
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if "tide-hf" in words:
                    found.append((path.relative_to(root).as_posix(), words[words.index("tide-hf") + 1:]))
    return found


def test_the_documented_command_lines_parse() -> None:
    """The docs' `tide-hf bench --modes ...` lines outlived the flags they used."""
    lines = documented_command_lines()
    assert any(argv[:2] == ["bench", "overhead"] for _, argv in lines)
    for where, argv in lines:
        if "--help" in argv:
            continue
        try:
            build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: tide-hf {shlex.join(argv)} does not parse (stderr names the argument)")


def test_every_help_page_fits_a_screen(monkeypatch) -> None:
    """`tide-hf --help`, every command's and every bench section's: at most HELP_LINES lines (calibrate's was 125,
    bench's 126: 111 options in no groups)."""
    monkeypatch.setenv("COLUMNS", str(HELP_COLUMNS))
    pages = {"tide-hf": build_parser(), **subparsers()}
    assert {"bench overhead", "bench modes", "bench batches", "bench continuous", "bench baselines", "bench kernels",
            "bench synthetic", "bench gpu", "calibrate", "demo", "analyze", "env"} <= set(pages)
    for name, parser in pages.items():
        lines = parser.format_help().splitlines()
        assert len(lines) <= HELP_LINES, f"{name} --help: {len(lines)} lines"
        assert max(map(len, lines)) <= HELP_COLUMNS, f"{name} --help: a line wider than {HELP_COLUMNS}"


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["bench", "--help"], ["bench", "modes", "--help"],
                                  ["calibrate", "--dataset", "sotu", "--help"]])
def test_help_does_not_import_torch(argv: list[str]) -> None:
    code = ("import json, sys\nfrom tide_hf.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n"
            "    pass\nprint(json.dumps(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True)
    assert "usage: tide-hf" in out.stdout
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize("argv", [["bench", "overhead", "--router", "/no/such/router"],
                                  ["analyze", "--router", "./no-router"]])
def test_a_missing_router_folder_is_named_before_torch_loads(argv: list[str]) -> None:
    """It was found after torch and transformers were imported (seconds)."""
    code = ("import json, sys\nfrom tide_hf.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    print(e)\nprint(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True)
    said, imported = out.stdout.strip().splitlines()
    command = " ".join(argv[:-2])
    assert said == f"tide-hf {command}: error: no TIDE router folder at {argv[-1]}" and json.loads(imported) == []


def test_a_bare_router_name_that_is_no_folder_is_named_before_the_hub_is_asked(tmp_path: Path) -> None:
    """A name without '/' is no Hub repo id: it went to the Hub and retried for ~25 s offline."""
    code = ("import json, sys\nfrom tide_hf.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    print(e)\nprint(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code, "analyze", "--router", "my-routr"], capture_output=True,
                         text=True, check=True, cwd=tmp_path)
    said, imported = out.stdout.strip().splitlines()
    assert said == (f"tide-hf analyze: error: no TIDE router folder named 'my-routr' here ({tmp_path}), and it is "
                    "not a Hub repo id (those read 'owner/name')") and json.loads(imported) == []


def test_every_option_has_help_and_every_command_a_description() -> None:
    for name, parser in subparsers().items():
        assert parser.description and "example: tide-hf " + name in parser.description
        assert parser.prog == "tide-hf " + name
        assert "2-core CPU" in parser.description, f"{name}: no time expectation"
        for action in parser._actions:
            assert action.help and action.help.strip(), f"{name} {action.option_strings}: no help"


def test_help_shows_defaults_and_bench_requires_router() -> None:
    parsers = subparsers()
    assert "(default: 256)" in " ".join(parsers["calibrate"].format_help().split())
    for section in ("overhead", "batches", "continuous", "baselines"):
        usage = parsers[f"bench {section}"].format_usage()
        assert "--router" in usage and "[--router" not in usage, usage
    assert "overhead" in parsers["bench"].format_help() and "synthetic" in parsers["bench"].format_help()


def test_the_cli_defaults_and_help_are_the_configs_own() -> None:
    """Parsed with no optional flag, `calibrate` holds CalibrationConfig's defaults and leaves the --set fields
    unset (calibrate() then takes the config's own); each flag shows its field's help; `analyze` starts from the
    same convergence settings."""
    defaults, flagged = CalibrationConfig(), [name for name in OWN_FLAGS if name != "dataset"]
    args = build_parser().parse_args(["calibrate", "--dataset", "sotu", "--output", "r"])
    assert {name: getattr(args, name) for name in flagged} == {name: getattr(defaults, name) for name in flagged}
    assert not [name for name in SET_FIELDS if hasattr(args, name)]
    page = "".join(subparsers()["calibrate"].format_help().split())  # wrapped anywhere: compared without spaces
    fields = {f.name: f for f in dataclasses.fields(CalibrationConfig)}
    assert all("".join(fields[name].metadata["help"].split()) in page for name in flagged)
    analyze = build_parser().parse_args(["analyze"])
    read = ("seed", "checkpoint_interval", "convergence_threshold")
    assert [getattr(analyze, name) for name in read] == [getattr(defaults, name) for name in read]


def test_synthetic_choices_match_the_bench() -> None:
    from tide_bench.sections import synthetic as parser
    from tide_bench.synthetic import SHAPES, build_model, configurations

    model = build_model("tiny", "cpu", torch.float32)
    assert parser.CONFIGS == tuple(configurations(model, 4)) and parser.SHAPES == tuple(SHAPES)


@pytest.mark.parametrize("argv,message", [
    (["bench", "overhead", "--router", "r", "--reps", "0"], "argument --reps: must be >= 1, got 0"),
    (["bench", "overhead", "--router", "r", "--batch-sizes", "0"], "argument --batch-sizes: must be >= 1"),
    (["analyze", "--agreements", "1.5"], "argument --agreements: must be a number in [0, 1], got 1.5"),
    (["analyze", "--agreements", "nan"], "argument --agreements: must be a number in [0, 1], got nan"),
    (["analyze", "--bins", "0"], "argument --bins: must be >= 1"),
    (["analyze", "--convergence-threshold", "5"], "argument --convergence-threshold: must be a cosine similarity"),
    (["analyze", "--convergence-threshold", "nan"], "argument --convergence-threshold: must be a cosine similarity"),
    (["bench", "modes", "--near-identity-after", "16", "--near-identity-scale", "nan"],
     "argument --near-identity-scale: must be a finite number > 0"),
    (["demo", "--repeats", "0"], "argument --repeats: must be >= 1"),
    (["demo", "--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1"),
    (["calibrate", "--dataset", "sotu", "--output", "r", "--set", "kl_treshold=0.2"],
     "argument --set: 'kl_treshold' is no TideRouterConfig field calibration reads (did you mean kl_threshold"),
    (["calibrate", "--dataset", "sotu", "--output", "r", "--set", "label=kl"],
     "argument --set: label has a flag of its own: --label"),
    (["calibrate", "--dataset", "sotu", "--output", "r", "--set", "max_train_tokens"],
     "argument --set: 'max_train_tokens' is not KEY=VALUE"),
    # a flag of another section (or command) is no flag of this one: refused, not ignored
    (["bench", "kernels", "--router", "r"], "unrecognized arguments: --router r"),
    (["bench", "overhead", "--router", "r", "--depths", "3"], "unrecognized arguments: --depths 3"),
    (["bench", "synthetic", "tiny", "--targets", "0.9"], "unrecognized arguments: --targets 0.9"),
    (["bench", "gpu", "--reps", "5"], "unrecognized arguments: --reps 5"),
    (["demo", "--num-samples", "7"], "unrecognized arguments: --num-samples 7"),
])
def test_bad_values_are_refused_while_parsing(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["bench", "modes"], "give --router DIR, or --near-identity-after K"),
    (["bench", "modes", "--near-identity-after", "16", "--router", "r"],
     "--near-identity-after builds its own routers; leave out --router"),
    (["bench", "modes", "--router", "r", "--near-identity-scale", "2"],
     "--near-identity-scale goes with --near-identity-after"),
    (["bench", "overhead", "--router", "r", "--num-prompts", "2", "--batch-sizes", "4"],
     "--batch-sizes 4 needs at least as many --num-prompts (got 2)"),
    (["bench", "batches", "--router", "r", "--num-prompts", "2", "--batch-sizes", "4"], "--batch-sizes 4 needs"),
    (["bench", "overhead", "--router", "r", "--new-tokens", "1"],
     "--new-tokens 1: decode tokens are the ones after the first"),
    (["bench", "modes", "--router", "a", "b"], "bench modes measures one router; give one --router per command"),
    (["bench", "baselines", "--router", "a", "b"], "bench baselines measures one router"),
    (["bench", "overhead", "--router", "a", "a"], "a --router is given twice"),
])
def test_bench_refuses_what_it_would_ignore_or_miscount(argv, message) -> None:
    from tide_hf.cli import main

    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)")):
        main(argv)


def test_set_reaches_calibration_as_the_flags_it_replaces_did(monkeypatch) -> None:
    """The hyper-parameters that were flags (--max-train-tokens, --exit-head-rank, --min-layers, ...) are
    `--set KEY=VALUE`: each reaches calibrate() as the config field it names, parsed as JSON; an unset one keeps
    the library's default (the flags' defaults were those)."""
    import tide_hf.calibration.command as command

    seen = {}
    monkeypatch.setattr(command, "load_model", lambda name, dtype: ("model", "tok"))
    monkeypatch.setattr(command, "to_process_device", lambda model: model)
    monkeypatch.setattr(command, "calibrate", lambda model, tok, dataset, **kwargs: seen.update(kwargs))
    args = build_parser().parse_args(["calibrate", "--dataset", "sotu", "--output", "r", "--label", "kl", "--set",
                                      "max_train_tokens=4096",
                                      "exit_head_rank=64", "min_layers=8", "convergence_threshold=0.5",
                                      "checkpoint_layers=[4, 8]", "exit_head_ridge=null", "learning_rate=3e-4"])
    command.calibrate_from_args(args)
    assert {k: seen[k] for k in ("label", "max_train_tokens", "exit_head_rank", "min_layers", "convergence_threshold",
                                 "checkpoint_layers", "exit_head_ridge", "learning_rate")} == {
        "label": "kl", "max_train_tokens": 4096, "exit_head_rank": 64, "min_layers": 8, "convergence_threshold": 0.5,
        "checkpoint_layers": [4, 8], "exit_head_ridge": None, "learning_rate": 3e-4}
    seen.clear()
    command.calibrate_from_args(build_parser().parse_args(["calibrate", "--dataset", "sotu", "--output", "r"]))
    assert "max_train_tokens" not in seen and "min_layers" not in seen and seen["num_samples"] == 256


def test_set_and_the_flags_offer_every_field_calibrate_reads() -> None:
    """A CalibrationConfig field neither a flag nor --set offered would be out of the CLI's reach; and the command
    passes every one on."""
    import tide_hf.calibration.command as command

    fields = {f.name for f in dataclasses.fields(CalibrationConfig)}
    offered = set(SET_FIELDS) | set(OWN_FLAGS)
    assert offered - fields == {"dataset"} and fields <= offered  # dataset: calibrate()'s own argument
    assert set(command.CONFIG_OPTIONS) == fields - set(SAMPLING_FIELDS)


def test_a_bad_set_value_is_named_in_one_line_before_calibration(tmp_path, monkeypatch, capsys) -> None:
    """--convergence-threshold 1.5 was refused by its argparse type; as --set convergence_threshold=1.5 the router
    config refuses it, before any text is read."""
    from helpers import ByteTokenizer, make_tiny_llama

    import tide_hf.calibration.command as command
    from tide_hf.cli import main

    monkeypatch.setattr(command, "load_model", lambda name, dtype: (make_tiny_llama(), ByteTokenizer()))
    with pytest.raises(SystemExit) as info:
        main(["calibrate", "--dataset", str(tmp_path / "unread"), "--set", "convergence_threshold=1.5",
              "--output", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert info.value.code == 1 and len(err.strip().splitlines()) == 1, err
    assert "convergence_threshold must be a finite number in [-1.0, 1.0], got 1.5" in err


def test_calibrate_refuses_unwritable_outputs_before_loading_anything(tmp_path, capsys) -> None:
    from tide_hf.cli import main

    (tmp_path / "afile").write_text("x")
    (tmp_path / "results").mkdir()
    for extra, message in ((["--output", str(tmp_path / "afile" / "sub")], "is not a writable folder"),
                           (["--output", str(tmp_path / "o"), "--results", str(tmp_path / "results")],
                            "is a folder; give a file name")):
        with pytest.raises(SystemExit) as info:
            main(["calibrate", "--dataset", "sotu", "--model", str(tmp_path / "no-model"), *extra])
        err = capsys.readouterr().err
        assert info.value.code == 1 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs a /proc file system")
def test_an_output_on_a_file_system_that_refuses_folders_is_refused_before_loading_anything(capsys) -> None:
    """Permissions let root write to /proc, so the check passed and the whole calibration ran before the save
    failed with a raw ENOENT."""
    from tide_hf.cli import main

    with pytest.raises(SystemExit) as info:
        main(["calibrate", "--dataset", "sotu", "--model", "/no/such/model", "--output", "/proc/tide-router"])
    err = capsys.readouterr().err
    assert info.value.code == 1 and "--output /proc/tide-router cannot be written: /proc refuses new folders" in err
    assert len(err.strip().splitlines()) == 1 and not Path("/proc/tide-router").exists()


def test_a_calibration_warning_prints_once_as_one_line(monkeypatch, capsys) -> None:
    """Calibration warnings went to a logger and to `warnings`: the CLI printed each twice, once with a source
    excerpt. Now one line, in the form of the CLI's errors."""
    import tide_hf.calibration.command as command
    from tide_hf.calibration.pipeline import loud
    from tide_hf.cli import main

    monkeypatch.setattr(command, "run", lambda args: loud("TIDE calibration: a test warning"))
    main(["calibrate", "--dataset", "sotu", "--output", "unused"])
    assert capsys.readouterr().err == "tide-hf calibrate: warning: TIDE calibration: a test warning\n"


def test_calibrate_refuses_a_bad_push_repo_id_and_results_inside_output_before_loading_anything(tmp_path,
                                                                                                capsys) -> None:
    """A bad --push-to-hub id failed with a traceback after the whole calibration; --results inside --output
    overwrote the saved router's config.json (or left a file that made a later --overwrite refuse the folder)."""
    from tide_hf.cli import main

    out = str(tmp_path / "r")
    for extra, message in ((["--push-to-hub", "not a valid/repo id!!"], "--push-to-hub 'not a valid/repo id!!' is "
                            "not a Hub repo id"),
                           (["--results", str(tmp_path / "r" / "config.json")], "--results .* and --output .* overlap"),
                           (["--results", str(tmp_path / "r" / "x" / "run.json")], "overlap")):
        with pytest.raises(SystemExit) as info:
            main(["calibrate", "--dataset", "sotu", "--model", str(tmp_path / "no-model"), "--output", out, *extra])
        err = capsys.readouterr().err
        assert info.value.code == 1 and len(err.strip().splitlines()) == 1, err
        assert re.search(message, err) and "model folder not found" not in err, err


def test_calibrate_names_a_model_folder_without_a_tokenizer_in_one_line(tmp_path, capsys) -> None:
    """transformers' error was a traceback about sentencepiece."""
    from helpers import make_tiny_llama

    from tide_hf.cli import main

    make_tiny_llama().save_pretrained(tmp_path / "m")
    capsys.readouterr()  # the save's progress bar
    with pytest.raises(SystemExit) as info:
        main(["calibrate", "--dataset", "sotu", "--model", str(tmp_path / "m"), "--output", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert info.value.code == 1 and len(err.strip().splitlines()) == 1, err
    assert "has no tokenizer files" in err and not (tmp_path / "r").exists()


def test_calibrate_names_a_seq_len_past_the_models_positions_in_one_line(tmp_path, monkeypatch, capsys) -> None:
    """GPT-2 crashed mid-forward with a bare IndexError traceback."""
    from helpers import ByteTokenizer
    from transformers import GPT2Config, GPT2LMHeadModel

    import tide_hf.calibration.command as command
    from tide_hf.cli import main

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=9, n_head=4)).eval()
    monkeypatch.setattr(command, "load_model", lambda name, dtype: (gpt2, ByteTokenizer()))
    with pytest.raises(SystemExit) as info:
        main(["calibrate", "--model", "gpt2-tiny", "--dataset", str(tmp_path / "unread"), "--seq-len", "100",
              "--output", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert info.value.code == 1 and len(err.strip().splitlines()) == 1, err
    assert "seq_len=100 is longer than the model's context (max_position_embeddings=64 positions)" in err


def test_ctrl_c_prints_one_line_and_exits_130(monkeypatch, capsys) -> None:
    """Ctrl-C during a long calibration printed a traceback through torch's frames."""
    import tide_hf.calibration.command as command
    from tide_hf.cli import main

    def interrupted(args) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "run", interrupted)
    with pytest.raises(SystemExit) as info:
        main(["calibrate", "--dataset", "sotu", "--output", "unused"])
    assert info.value.code == 130 and capsys.readouterr().err == "tide-hf calibrate: interrupted\n"


def test_one_router_folder_spelled_two_ways_is_given_twice(tmp_path, monkeypatch) -> None:
    """`--router r ./r` passed as two routers: the table had two rows of the same router."""
    from tide_hf.cli import main

    (tmp_path / "r").mkdir()
    monkeypatch.chdir(tmp_path)
    for second in ("./r", str(tmp_path / "r"), "r/"):
        with pytest.raises(SystemExit, match="a --router is given twice"):
            main(["bench", "overhead", "--router", "r", second])


@pytest.mark.parametrize("argv", [["analyze", "--router", "r", "--targets", "0"],
                                  ["bench", "baselines", "--router", "r", "--targets", "0"]])
def test_a_zero_quality_target_is_refused_by_the_parser(argv, capsys) -> None:
    """--targets 0 passed the parser ([0, 1]) and was refused by attach after the forward passes (analyze left
    its plots behind)."""
    from tide_hf.cli import main

    with pytest.raises(SystemExit):
        main(argv)
    assert "must be a number in (0, 1], got 0" in capsys.readouterr().err


def test_a_router_made_by_hand_has_read_none_of_the_text() -> None:
    """A router built from a config (num_samples / seq_len None) crashed held_out_texts, so bench and analyze,
    with a raw TypeError; it read no document, so all are held out."""
    from helpers import ByteTokenizer, make_documents, make_model, new_router

    from tide_hf.calibration import held_out_texts

    texts = make_documents(5, 20)
    router = new_router(make_model())
    assert router.config.num_samples is None
    assert held_out_texts(ByteTokenizer(), texts, router.config) == texts


@pytest.mark.parametrize(("argv", "message"), [
    (["analyze", "--targets", "0.9"], "--targets goes with --router"),
    (["analyze", "--prompt-len", "8"], "--prompt-len goes with --router"),
    (["bench", "modes", "--near-identity-after", "16", "--depths", "3"],
     "--depths does not apply with --near-identity-after"),
    (["bench", "modes", "--near-identity-after", "16", "--thresholds", "0.5"],
     "--thresholds does not apply with --near-identity-after"),
])
def test_a_flag_the_run_never_reads_is_refused(argv, message) -> None:
    """They were accepted and ignored (rc 0); a flag of another bench section no section parser knows."""
    from tide_hf.cli import main

    with pytest.raises(SystemExit, match=message):
        main(argv)


@pytest.mark.parametrize(("paths", "command", "flags"), [
    (False, ["analyze"], ["--targets", "0.9"]),
    (False, ["bench", "baselines"], ["--targets", "0.9"]),
    (False, ["bench", "baselines"], ["--ppl-targets", "0.1"]),
    (True, ["bench", "baselines"], ["--thresholds", "0.3"]),
])
def test_a_flag_the_routers_kind_never_reads_is_refused(tmp_path, monkeypatch, paths, command, flags) -> None:
    """--targets on a router without exit paths (analyze, bench baselines) and --thresholds on one with them
    (bench baselines) were accepted and ignored: no row measured what was asked."""
    from tide_hf.cli import main

    monkeypatch.chdir(tmp_path)
    model = make_model()
    closed = [1.0] * len(new_router(model).checkpoint_layers)  # a path's first point: every checkpoint closed
    path = {"thresholds": [closed], "errors": [0], "n": 0, "n_next": 0, "nll_sum": [0.0], "nll_sumsq": [0.0]}
    new_router(model, exit_paths={"agreement": path} if paths else {}).save_pretrained(tmp_path / "r")
    with pytest.raises(SystemExit, match=f"tide-hf {' '.join(command)}: {flags[0]} does not apply to ./r, a router "
                       "with"):
        main([*command, "--router", "./r", *flags])


def test_env_prints_what_a_bug_report_needs(capsys) -> None:
    """`tide-hf env`: the versions this process runs, the kernel backend of each device, the cache folders."""
    import torch
    import transformers

    from tide_hf.assets import cache_dir
    from tide_hf.cli import main
    from tide_hf.kernels import active_backend

    main(["env"])
    lines = capsys.readouterr().out.splitlines()
    assert f"torch: {torch.__version__}" in lines and f"transformers: {transformers.__version__}" in lines
    assert f"kernels cpu: {active_backend('cpu')}" in lines
    assert f"tide_hf_cache: {cache_dir()}" in lines


def test_env_warns_on_a_transformers_newer_than_the_newest_tested(capsys, monkeypatch) -> None:
    """`tide-hf env` says when transformers is newer than the newest release the suite passed on, and names the
    release to fall back to; on that release itself it says nothing."""
    import transformers

    from tide_hf.cli import main
    from tide_hf.compat import NEWEST_TESTED_TRANSFORMERS
    from tide_hf.eval import environment

    main(["env"])
    installed = transformers.__version__
    warned = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert bool(warned) == (environment.Version(installed) > environment.Version(NEWEST_TESTED_TRANSFORMERS))
    newer = NEWEST_TESTED_TRANSFORMERS.split(".")[0] + ".999.0"
    monkeypatch.setattr(transformers, "__version__", newer)
    main(["env"])
    warned = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert warned == [f"warning: transformers {newer} is newer than {NEWEST_TESTED_TRANSFORMERS}, the newest release "
                      f"tide_hf's test suite passed on: if something fails, try pip install "
                      f"'transformers=={NEWEST_TESTED_TRANSFORMERS}'"]
