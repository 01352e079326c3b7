"""One decode step of `generate` under each serving mode, traced with `sys.setprofile`: the tide_hf modules and
functions it enters. docs/reference/development.md shows the same lists between its `step-trace` markers; this test
keeps them true (on a mismatch it prints the section to paste). The goal for skip mode is 5 modules or fewer."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from helpers import left_padded, make_model, mixed_router

import tide_hf

DOC = Path(__file__).resolve().parents[1] / "docs" / "reference" / "development.md"
BEGIN, END = "<!-- step-trace: begin -->", "<!-- step-trace: end -->"
MODES = {"skip": {"mode": "skip"}, "select": {"mode": "select"}}
TRACED_FORWARD = 2  # generate's forwards: the prefill, then decode steps; the second is a decode step
TRACED_BACKEND = "cpp"  # the kernel backend the page's lists were traced with (tide_hf.kernels.active_backend)
NEW_TOKENS = 3  # a third forward closes the traced step (its logits processor and stopping criteria ran)


def traced_step(mode: str) -> dict[str, list[str]]:
    """tide_hf module -> the functions one decode step enters (from the start of generate's second forward to the
    start of its third), after a warm-up generate (first-use work such as the kernels' load is not a step's)."""
    model = make_model()
    ids, mask = left_padded()
    ids, mask = ids[:1], mask[:1]
    router = mixed_router(model, ids, mask)
    entered: dict[str, set[str]] = {}
    forwards = [0]

    def count(*_):
        forwards[0] += 1

    def profile(frame, event, _arg):
        name = frame.f_globals.get("__name__", "")
        if event == "call" and forwards[0] == TRACED_FORWARD and name.startswith("tide_hf"):
            entered.setdefault(name, set()).add(frame.f_code.co_name)

    with tide_hf.attach(model, router, **MODES[mode]), torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)  # warm-up
        hook = model.register_forward_pre_hook(count)
        sys.setprofile(profile)
        try:
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        finally:
            sys.setprofile(None)
            hook.remove()
    return {module: sorted(functions) for module, functions in sorted(entered.items())}


def section(traces: dict[str, dict[str, list[str]]]) -> str:
    """The development page's section for `traces` (mode -> module -> functions)."""
    lines = [BEGIN]
    for mode, modules in traces.items():
        lines += ["", f"{mode} mode, {len(modules)} modules:", ""]
        lines += [f"- `{module}`: " + ", ".join(f"`{f}`" for f in functions) for module, functions in modules.items()]
    return "\n".join([*lines, "", END])


@pytest.mark.usefixtures("one_intra_op_thread")
def test_the_development_page_lists_what_one_decode_step_enters() -> None:
    from tide_hf.kernels import active_backend

    if active_backend("cpu") != TRACED_BACKEND:  # the PyTorch path enters other functions
        pytest.skip(f"the page lists the steps of the compiled CPU kernels; this run has {active_backend('cpu')!r}")
    traces = {mode: traced_step(mode) for mode in MODES}
    assert all(traces.values())  # the profiler saw tide_hf work in each step
    text = DOC.read_text()
    found = re.search(re.escape(BEGIN) + ".*?" + re.escape(END), text, re.S)
    assert found is not None, f"no step-trace section in {DOC.name}; paste:\n{section(traces)}"
    assert found.group(0) == section(traces), f"the step trace changed; paste into {DOC.name}:\n{section(traces)}"
