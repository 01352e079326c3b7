"""The demo's router cache (a second run does not calibrate again; a half-written folder is never reused) and
the plotting error after a plain install."""

from __future__ import annotations

import argparse
import builtins
import statistics
from pathlib import Path

import pytest
import torch
from helpers import constant_router, make_model, new_router

from tide_hf.assets import default_dataset
from tide_hf.errors import TideArgumentError, TideError, TideRouterFileError
from tide_hf.eval import demo

WIDE = 128  # a model wider than the demo's rank-64 exit heads


def demo_args(output: Path | None = None, **calibration) -> argparse.Namespace:
    """What `tide-hf demo [--output DIR]` runs with: the demo's fixed calibration settings, `calibration` changing
    some (as a later version of the demo might)."""
    from tide_hf.cli import build_parser
    from tide_hf.cli.demo import demo_settings

    args = demo_settings(build_parser().parse_args(["demo", *([] if output is None else ["--output", str(output)])]))
    assert set(calibration) <= set(vars(args))
    return argparse.Namespace(**{**vars(args), **calibration})


def test_second_run_reuses_the_cached_router(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDE_HF_CACHE", str(tmp_path))
    model = make_model()
    calls = []

    def calibrate(args):
        calls.append(args)
        return model, "tok", new_router(model)

    def load(name, dtype):
        return model, "tok"

    monkeypatch.setattr(demo, "calibrate_from_args", calibrate)
    monkeypatch.setattr(demo, "load_model", load)
    args = demo_args()
    folder = demo.router_folder(args)
    assert folder.is_relative_to(tmp_path) and folder != Path.cwd()
    *_, first, reused = demo.get_router(args)
    assert not reused and len(calls) == 1 and demo.is_complete(folder)
    *_, second, reused = demo.get_router(demo_args())
    assert reused and len(calls) == 1, "the second run calibrated again"
    assert second.config.base_fingerprint == first.config.base_fingerprint
    assert all((a == b).all() for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    other = demo.router_folder(demo_args(num_samples=7))
    assert other != folder, "another calibration setting must not reuse this router"


def test_the_cache_key_follows_what_local_paths_hold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--dataset text.txt` run in another folder (other text) reused the router calibrated on the first one's,
    and a model folder given new weights kept its key."""
    monkeypatch.setenv("TIDE_HF_CACHE", str(tmp_path / "cache"))
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "text.txt").write_text(f"speech {name}")
    monkeypatch.chdir(tmp_path / "a")
    first = demo.router_folder(demo_args(dataset="text.txt"))
    assert demo.router_folder(demo_args(dataset="text.txt")) == first  # the same text: the same router
    assert demo.router_folder(demo_args(dataset=str(tmp_path / "a" / "text.txt"))) == first  # however spelled
    monkeypatch.chdir(tmp_path / "b")
    assert demo.router_folder(demo_args(dataset="text.txt")) != first
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors").write_bytes(b"1")
    before = demo.router_folder(demo_args(model=str(tmp_path / "m")))
    (tmp_path / "m" / "model.safetensors").write_bytes(b"22")  # new weights in the same folder
    assert demo.router_folder(demo_args(model=str(tmp_path / "m"))) != before
    assert demo.router_folder(demo_args()) == demo.router_folder(demo_args(model="smollm2", dataset="sotu"))


def test_a_half_written_folder_is_not_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDE_HF_CACHE", str(tmp_path))
    folder = demo.router_folder(demo_args())
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # a run killed before the weights were written
    assert not demo.is_complete(folder)
    model = make_model()
    monkeypatch.setattr(demo, "calibrate_from_args", lambda args: (model, "tok", new_router(model)))
    monkeypatch.setattr(demo, "load_model", lambda name, dtype: (model, "tok"))
    *_, router, reused = demo.get_router(demo_args())
    assert not reused and demo.is_complete(folder) and not list(folder.parent.glob(".*tmp*"))


def test_an_output_folder_is_checked_before_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--output holding the user's files is refused, never emptied; one holding a router made with other
    settings is neither reused nor replaced without --recalibrate."""
    model = make_model(hidden=WIDE)
    calls = []

    def calibrate(args):
        calls.append(args)
        made = {name: getattr(args, name) for name in ("num_samples", "seq_len", "exit_head", "exit_head_rank",
                                                       "max_train_tokens")}
        return model, "tok", new_router(model, **made, dataset=default_dataset(args.dataset))

    monkeypatch.setattr(demo, "calibrate_from_args", calibrate)
    monkeypatch.setattr(demo, "load_model", lambda name, dtype: (model, "tok"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    with pytest.raises(TideRouterFileError, match="not a TIDE router"):
        demo.get_router(demo_args(output=mine))
    assert not calls and (mine / "notes.txt").read_text() == "precious"
    out = tmp_path / "out"
    demo.get_router(demo_args(output=out))
    with pytest.raises(TideArgumentError, match=r"other settings: num_samples=7 \(router: 128\);"):
        demo.get_router(demo_args(output=out, num_samples=7))
    assert len(calls) == 1
    *_, reused = demo.get_router(demo_args(output=out))
    assert reused and len(calls) == 1


def test_plot_without_matplotlib_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from tide_hf.plotting import PlottingUnavailable, pyplot

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ModuleNotFoundError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(PlottingUnavailable, match=r"pip install matplotlib") as caught:
        pyplot()
    assert isinstance(caught.value, TideError)  # the CLI prints it as one line, not a traceback


class ChatTokenizer:
    """The two calls the demo's comparison makes of a tokenizer: a chat prompt's ids, and text back."""

    def apply_chat_template(self, messages: list[dict], **_) -> dict:
        ids = torch.tensor([list(messages[-1]["content"].encode())])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def decode(self, ids: torch.Tensor, skip_special_tokens: bool = True) -> str:
        return bytes(ids.tolist()).decode("utf-8", "replace")


@pytest.mark.parametrize("mode", [None, "skip"])
def test_the_comparison_times_interleaved_runs_and_reports_medians_and_their_range(mode, monkeypatch,
                                                                                   capsys) -> None:
    """One stock and one TIDE run were timed (noise on a shared machine read as a speed-up or a loss): now stock,
    stock on the fast linear path, TIDE, TIDE on the fast path, stock, ... after one warm-up each, TIDE attached
    and the fast path on in their runs only; the table gives each one's median tokens/s, their range and the
    ratios against stock, beside what each step did. attach's default (speculative) gives stock's tokens."""
    import tide_hf
    from tide_hf.runtime import get_handle
    from tide_hf.runtime.linears import FastForward

    model = make_model()
    model.generation_config.eos_token_id = None  # every run writes all its tokens
    router = constant_router(model, 30.0)  # every token exits at the first checkpoint
    order, real = [], demo.timed_generate
    switched = lambda: any(isinstance(v, FastForward) for m in model.modules() for v in vars(m).values())  # noqa: E731
    # every layer switched (measured on a model this small, eager wins and none would be)
    monkeypatch.setattr(demo, "fast_linears", lambda model: tide_hf.fast_linears(model, rows_from=1))

    def timed(model, inputs, new_tokens, desc):
        fast = switched()
        order.append((desc, get_handle(model) is not None, fast))
        return real(model, inputs, new_tokens, desc)

    monkeypatch.setattr(demo, "timed_generate", timed)
    result = demo.compare(model, ChatTokenizer(), router, "the state of the union", 6, repeats=3, mode=mode)
    assert order == [(f"{label} {i}/3", attached, fast) for i in (1, 2, 3)
                     for label, attached, fast in (("stock", False, False), ("stock, fast linears", False, True),
                                                   ("TIDE", True, False), ("TIDE, fast linears", True, True))]
    stock, tide = result["stock"], result["tide"]
    for run in (stock, result["fast"], tide, result["tide_fast"]):
        assert len(run["tok_s_runs"]) == 3 and run["tokens"] == 6
        assert run["tok_s"] == statistics.median(run["tok_s_runs"])
        assert run["vs_stock"] == [t / s for s, t in zip(stock["tok_s_runs"], run["tok_s_runs"])]
    assert result["tide_fast"]["vs_same_path"] == [t / s for s, t in zip(result["fast"]["tok_s_runs"],
                                                                        result["tide_fast"]["tok_s_runs"])]
    assert result["pair_ratios"] == tide["vs_stock"]
    assert result["fast"]["same_tokens"] == 1.0  # greedy on the fast path: stock's tokens on this tiny model
    if mode is None:
        assert result["mode"] == "speculative" and "default" in result["reason"]
        assert tide["same_tokens"] == result["tide_fast"]["same_tokens"] == 1.0 and tide["drafts"] is not None
    else:
        assert result["mode"] == "skip" and tide["layers"] < stock["layers"] == result["num_layers"]
    assert get_handle(model) is None
    assert not switched()
    capsys.readouterr()
    demo.print_comparison(result)
    table = capsys.readouterr().out.strip().splitlines()
    assert table[0].split() == ["stock", "stock,", "fast", "linears", "TIDE", "TIDE,", "fast", "linears"]
    assert table[1].startswith("tokens/s, median of 3") and f"{tide['tok_s']:.1f}" in table[1]
    low, high = min(result["pair_ratios"]), max(result["pair_ratios"])
    assert table[4].startswith("vs stock, each pair") and f"{low:.2f}x - {high:.2f}x" in table[4]
    assert any(line.startswith("per decode step") for line in table)
    assert any(line.startswith(f"TIDE: mode={result['mode']}") for line in table)


def test_the_demo_states_its_quality_target() -> None:
    line = demo.describe_target({"min_agreement": 0.95, "confidence": 0.9}, "sotu")
    assert ">= 95% top-1 agreement" in line and "90% confidence" in line and "(sotu)" in line
    both = demo.describe_target({"min_agreement": 0.97, "max_perplexity_increase": 0.05, "confidence": 0.8}, None)
    assert ">= 97%" in both and "<= +5% perplexity" in both and "80% confidence" in both
    assert "none" in demo.describe_target(None, "sotu")
    # stated as given, never rounded up to a stronger-sounding target (0.955 at 0.996 read ">= 96% ... 100%")
    odd = demo.describe_target({"min_agreement": 0.955, "max_perplexity_increase": 0.045, "confidence": 0.996}, None)
    assert ">= 95.5% top-1" in odd and "<= +4.5% perplexity" in odd and "99.6% confidence" in odd


def test_differences_read_missing_options_as_their_meaning() -> None:
    """No continuation means the corpus and no min_layers the first checkpoint; a router may hold fewer
    samples than asked for (the text ran out), never more."""
    model = make_model(hidden=WIDE)
    args = demo_args()
    text = default_dataset(args.dataset)  # what calibration records: the corpus's folder
    made = dict(num_samples=args.num_samples, seq_len=args.seq_len, exit_head=args.exit_head,
                exit_head_rank=args.exit_head_rank, max_train_tokens=args.max_train_tokens, dataset=text)
    assert demo.differences(new_router(model, **made), args) == []
    assert demo.differences(new_router(model, **{**made, "dataset": "/my/texts"}), args) == \
        [f"dataset={text} (router: /my/texts)"]  # a router of other text was reused
    assert demo.differences(new_router(model, **{**made, "num_samples": 48}), args) == []
    assert demo.differences(new_router(model, **{**made, "num_samples": 999}), args) == \
        ["num_samples=128 (router: 999)"]
    assert demo.differences(new_router(model, **made, continuation="greedy"), args) == \
        ["continuation=None (router: greedy)"]
    assert demo.differences(new_router(model, **made, min_layers=8), args) == ["min_layers=4 (router: 8)"]


def test_the_embedded_model_folder_is_a_plain_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder converted by an earlier version kept the GGUF quantization_config: transformers then treated the
    fp32 model as quantized (`.half()` refused, false warnings); it is dropped, nothing else changed."""
    import importlib.util
    import json

    from tide_hf import assets
    from tide_hf.errors import TideDependencyError

    monkeypatch.setenv("TIDE_HF_CACHE", str(tmp_path))
    folder = tmp_path / "SmolLM2-135M-Instruct"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    config = {"model_type": "llama", "hidden_size": 576, "quantization_config": {"quant_method": "gguf"}}
    (folder / "config.json").write_text(json.dumps(config))
    assert assets.smollm2_path() == folder
    assert json.loads((folder / "config.json").read_text()) == {"model_type": "llama", "hidden_size": 576}
    assert (folder / "model.safetensors").read_bytes() == b"weights"
    (folder / "config.json").unlink()  # not converted yet: the conversion needs gguf, named before any work
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(TideDependencyError, match="pip install gguf"):
        assets.smollm2_path()


def test_a_slower_tide_is_explained_with_the_run_s_own_figures(capsys) -> None:
    """When TIDE's median is below stock's the demo says why, from the exit rate and layers it measured (skip
    mode) or the drafts it took (speculative mode); when it is not, it says nothing of the kind."""
    def run(label: str, tok_s: float, **rest) -> dict:
        return {"label": label, "text": label, "tok_s": tok_s, "tok_s_runs": [tok_s], "layers": 30.0,
                "vs_stock": [tok_s / 10.0], "vs_same_path": [tok_s / 10.0], "same_tokens": 1.0,
                "first_difference": None, **rest}

    result = {"stock": run("stock", 10.0), "fast": run("stock, fast linears", 10.0),
              "tide": run("TIDE", 9.0, layers=27.0, exit_rate=0.11, drafts=None, same_tokens=0.5,
                          first_difference=3),
              "tide_fast": run("TIDE, fast linears", 9.0, layers=27.0, exit_rate=0.11, drafts=None),
              "num_layers": 30, "top1": 0.96, "target": None, "mode": "skip", "kv": "recompute",
              "reason": "asked for", "calibration_text": "sotu"}
    demo.print_comparison(result)
    out = capsys.readouterr().out
    assert "why TIDE is slower here: 11% of tokens exited, so at most 10% of the layer runs" in out
    assert "kv='recompute'" in out and "first token that differs from stock's: token 4" in out
    faster = {**result, "tide": {**result["tide"], "tok_s": 11.0, "tok_s_runs": [11.0]}}
    demo.print_comparison(faster)
    assert "why TIDE is slower" not in capsys.readouterr().out
    drafted = {"rounds": {"early_exit": 2, "lookup": 5}, "plain_steps": 40, "drafted": 30, "accepted": 12,
               "fallback": None}
    speculative = {**result, "mode": "speculative", "tide": {**result["tide"], "exit_rate": 0.0, "drafts": drafted}}
    demo.print_comparison(speculative)
    out = capsys.readouterr().out
    assert "it drafted in 7 rounds beside 40 plain steps, and 12 of 30 drafted tokens were accepted" in out
    assert "12/30 drafts accepted; rounds: early_exit 2, lookup 5" in out and "quality target" not in out


def test_the_demo_writes_its_figures_beside_the_router(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`tide-hf demo` writes what it printed as JSON (`<router folder>-demo.json`): the comparison's figures as
    `compare` returned them, the wall seconds of its phases and whether the router was reused."""
    import json

    monkeypatch.setenv("TIDE_HF_CACHE", str(tmp_path))
    model = make_model()
    model.generation_config.eos_token_id = None
    router = constant_router(model, 30.0)
    monkeypatch.setattr(demo, "get_router", lambda args: (model, ChatTokenizer(), router, True))
    results = []
    real = demo.compare
    monkeypatch.setattr(demo, "compare", lambda *a: results.append(real(*a)) or results[-1])
    monkeypatch.setattr(demo, "print_comparison", lambda result: None)
    args = demo_args()
    args.max_new_tokens, args.repeats, args.command = 4, 1, "tide-hf demo"
    demo.run(args)
    folder = demo.router_folder(args)
    written = json.loads(folder.with_name(f"{folder.name}-demo.json").read_text())
    assert written["router_reused"] is True and written["command"] == "tide-hf demo"
    assert set(written["seconds"]) == {"model_and_router", "timed_pairs"} and all(
        s >= 0 for s in written["seconds"].values())
    assert written["tide"]["tok_s"] == results[0]["tide"]["tok_s"] and written["pair_ratios"] == results[0][
        "pair_ratios"]
    assert "stats" not in written
