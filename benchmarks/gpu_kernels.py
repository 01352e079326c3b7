"""GPU check of the CUDA kernels: build, correctness of every route against a float64 reference, NaN / inf
propagation, poisoned memory, determinism, gather / scatter and the device-side index check, then timing of
every route and `tide-hf bench kernels`. Run from the repository root on a machine with a CUDA device:

    python benchmarks/gpu_kernels.py --out gpu-kernels

Each group runs in its own Python process, so a kernel that faults (which poisons the CUDA context) fails
its group and the others still run. Writes OUT/<group>.json, OUT/kernels.{json,md} (the bench) and
OUT/summary.json, and prints PASS / FAIL per group with the worst cases, then the timing tables.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GROUP_TIMEOUT_S = 1200
KINDS = ("rms", "rms_gemma", "rms_fp32", "layernorm", "none")
DTYPES = ("float32", "float16", "bfloat16")
ROWS = (1, 3, 8, 17, 64, 256, 1000, 4096)
HIDDEN = (4096, 576, 1003, 72)  # 1003: odd (no vector loads); 72: not a multiple of the 32-wide K stage
BOTTLENECK = (128, 48, 200)  # 200: beyond the tensor-core tile (that route refuses it)
# |kernel - float64 reference| bounds on scores in [0, 1]: max per dtype (a normalised element may round one
# ulp differently where the statistics are summed in another order), and median over a group (a systematic
# error, e.g. a lost hi/lo split or a misplaced rounding, moves every row).
MAX_ATOL = {"float32": 2e-6, "float16": 1e-4, "bfloat16": 2e-4}
MEDIAN_ATOL = 1e-6
ROUTES = ("auto", "small", "tensor", "gemm")
GROUPS = ("build", "correct-auto", "correct-small", "correct-tensor", "correct-gemm", "nonfinite", "poison",
          "determinism", "gather-scatter", "index-assert", "bench-routes", "bench-cli")


def _inputs(kind, n, h, b, dtype, seed):
    """Fresh random router + norm + hidden rows with LLM-like outlier channels (as tests/test_kernels.py)."""
    import torch

    from tide_hf.kernels import NormSpec

    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen) * 2
    hidden[:, : max(1, h // 64)] *= 20
    weight = torch.randn(h, generator=gen) * 0.2 + (0.0 if kind == "rms_gemma" else 1.0)
    bias = torch.randn(h, generator=gen) * 0.1
    shapes = (((b, h), h), ((b,), h), ((1, b), b), ((1,), b))
    router = [((torch.rand(s, generator=gen) * 2 - 1) / fan_in**0.5).cuda() for s, fan_in in shapes]
    dt = getattr(torch, dtype)
    spec = NormSpec(kind, weight.to("cuda", dt), bias.to("cuda", dt) if kind == "layernorm" else None, 1e-5)
    return hidden.to("cuda", dt), spec, router


def _reference64(hidden, spec, w1, b1, w2, b2):
    """HF's norm in the model dtype (exact roundings), then the router MLP in float64."""
    import torch

    from tide_hf.kernels import apply_norm

    z = apply_norm(hidden, spec).double()
    h = torch.relu(z @ w1.double().t() + b1.double())
    return torch.sigmoid(h @ w2.double().reshape(-1) + b2.double()).float()


def _is_refusal(err: Exception) -> bool:
    return "route" in str(err) and "CUDA error" not in str(err)


def group_build() -> dict:
    import torch

    from tide_hf.kernels import build

    start = time.perf_counter()
    ext = build.extension("cuda")
    return {"ok": ext is not None, "seconds": time.perf_counter() - start, "error": build.kernel_build_error("cuda"),
            "device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "has_path_binding": ext is not None and hasattr(ext, "norm_router_scores_path")}


def group_correct(route: str) -> dict:
    import torch

    from tide_bench.kernels import path_fn

    fn = path_fn(route)
    base_seed = int.from_bytes(os.urandom(4), "little")
    cases, errors, refused, worst = 0, [], 0, []
    for dtype in DTYPES:
        for h in HIDDEN:
            for b in BOTTLENECK:
                for kind in KINDS:
                    group_err = []
                    for n in ROWS:
                        seed = base_seed + cases
                        cases += 1
                        hidden, spec, router = _inputs(kind, n, h, b, dtype, seed)
                        with torch.inference_mode():
                            try:
                                got = fn(hidden, spec, *router)
                            except RuntimeError as err:
                                if _is_refusal(err):
                                    refused += 1
                                    continue
                                raise
                            torch.cuda.synchronize()
                            want = _reference64(hidden, spec, *router)
                        assert got.shape == (n,) and got.dtype == torch.float32, (got.shape, got.dtype)
                        diff = (got - want).abs()
                        bad_nan = int(got.isnan().sum())
                        group_err.append(diff)
                        m = diff.max().item() if n else 0.0
                        if bad_nan or m > MAX_ATOL[dtype]:
                            worst.append({"dtype": dtype, "hidden": h, "bottleneck": b, "kind": kind, "rows": n,
                                          "max_abs": m, "nan": bad_nan, "seed": seed})
                    if group_err:
                        err = torch.cat(group_err)
                        med = err.median().item()
                        errors.append({"dtype": dtype, "hidden": h, "bottleneck": b, "kind": kind,
                                       "max_abs": err.max().item(), "median_abs": med})
                        if med > MEDIAN_ATOL:
                            worst.append({"dtype": dtype, "hidden": h, "bottleneck": b, "kind": kind,
                                          "median_abs": med, "why": "median"})
    per_dtype = {d: max((e["max_abs"] for e in errors if e["dtype"] == d), default=None) for d in DTYPES}
    return {"ok": not worst and bool(errors), "route": route, "cases": cases, "refused": refused,
            "max_abs_by_dtype": per_dtype, "failures": worst[:20], "n_failures": len(worst), "groups": errors}


def group_nonfinite() -> dict:
    import torch

    from tide_bench.kernels import path_fn

    failures = []
    for route in ROUTES:
        fn = path_fn(route)
        for dtype in DTYPES:
            for kind in KINDS:
                for n in (1, 3, 17, 300):
                    hidden, spec, router = _inputs(kind, n, 1003, 128, dtype, seed=n)
                    router[3].fill_(30.0)  # a large b2: a dropped NaN would score ~1.0
                    hidden[0, 5] = float("nan")
                    hidden[-1, 7] = float("inf")
                    try:
                        with torch.inference_mode():
                            s = fn(hidden, spec, *router)
                    except RuntimeError as err:
                        if _is_refusal(err):
                            continue
                        raise
                    ok = bool(s[0].isnan()) and (kind == "none" or bool(s[-1].isnan()))
                    ok = ok and (n <= 2 or bool(s[1:-1].isfinite().all()))
                    if not ok:
                        failures.append({"route": route, "dtype": dtype, "kind": kind, "rows": n,
                                         "first": s[0].item(), "last": s[-1].item()})
    return {"ok": not failures, "failures": failures[:20], "n_failures": len(failures)}


def group_poison() -> dict:
    """Fill freed allocator blocks with NaN, then score finite rows: any unwritten output or scratch cell read
    by mistake shows up as NaN."""
    import torch

    from tide_bench.kernels import path_fn

    failures = []
    for route in ROUTES:
        fn = path_fn(route)
        for dtype in ("float32", "bfloat16"):
            for n, h in ((1, 4096), (5, 576), (64, 1003), (300, 4096), (4096, 576)):
                hidden, spec, router = _inputs("rms", n, h, 128, dtype, seed=n + h)
                junk = [torch.full((2**k,), float("nan"), device="cuda") for k in range(10, 27)]
                del junk
                try:
                    with torch.inference_mode():
                        s = fn(hidden, spec, *router)
                except RuntimeError as err:
                    if _is_refusal(err):
                        continue
                    raise
                want = _reference64(hidden, spec, *router)
                if not bool(s.isfinite().all()) or (s - want).abs().max().item() > MAX_ATOL[dtype]:
                    failures.append({"route": route, "dtype": dtype, "rows": n, "hidden": h,
                                     "nan": int(s.isnan().sum()), "max_abs": (s - want).abs().max().item()})
    return {"ok": not failures, "failures": failures}


def group_determinism() -> dict:
    import torch

    from tide_bench.kernels import path_fn

    failures = []
    for route in ROUTES:
        fn = path_fn(route)
        for dtype in DTYPES:
            for n in (1, 64, 4096):
                hidden, spec, router = _inputs("layernorm", n, 4096, 128, dtype, seed=7)
                try:
                    with torch.inference_mode():
                        outs = [fn(hidden, spec, *router) for _ in range(5)]
                except RuntimeError as err:
                    if _is_refusal(err):
                        continue
                    raise
                if not all(torch.equal(outs[0], o) for o in outs[1:]):
                    failures.append({"route": route, "dtype": dtype, "rows": n})
    return {"ok": not failures, "failures": failures}


def group_gather_scatter() -> dict:
    import torch

    from tide_hf import kernels

    failures = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.uint8):
        for shape in ((9, 40), (1000, 3), (9, 3, 5), (9,), (4096, 4096), (7, 4097)):
            n = shape[0]
            x = (torch.randn(shape, device="cuda") * 100).to(dtype)
            for index in (torch.randperm(n, device="cuda")[: max(1, n // 2)], torch.tensor([n - 1, 0, n - 1],
                                                                                           device="cuda")):
                ok = torch.equal(kernels.gather_rows(x, index), x.index_select(0, index))
                view = x[1:] if n > 1 else x  # an offset base pointer: narrower vector loads
                ok = ok and torch.equal(kernels.gather_rows(view, index.clamp(max=view.shape[0] - 1)),
                                        view.index_select(0, index.clamp(max=view.shape[0] - 1)))
                perm = torch.randperm(n, device="cuda")
                dst = torch.zeros_like(x)
                kernels.scatter_rows_(dst, perm, x)
                ok = ok and torch.equal(dst, torch.zeros_like(x).index_copy_(0, perm, x))
                if not ok:
                    failures.append({"dtype": str(dtype), "shape": list(shape)})
    return {"ok": not failures, "failures": failures}


def group_index_assert() -> dict:
    """An out-of-range CUDA index must raise (device-side assert), never write out of bounds silently."""
    import torch

    from tide_hf import kernels

    x = torch.zeros(4, 3, device="cuda")
    try:
        kernels.gather_rows(x, torch.tensor([4], device="cuda"))
        torch.cuda.synchronize()
    except RuntimeError as err:
        return {"ok": True, "raised": str(err).splitlines()[0]}
    return {"ok": False, "raised": None}


def group_bench_routes() -> dict:
    import torch

    from tide_bench.kernels import (
        GPU_BOTTLENECK,
        GPU_HIDDEN,
        GPU_ROWS,
        SMOL_HIDDEN,
        SMOL_ROWS,
        device_bench,
        device_roofline,
        path_fn,
    )
    from tide_hf.kernels import norm_router_scores_reference

    roof = device_roofline(torch.device("cuda"))
    rows = []
    shapes = [(n, GPU_HIDDEN) for n in GPU_ROWS] + [(n, SMOL_HIDDEN) for n in SMOL_ROWS]
    variants = {**{r: path_fn(r) for r in ROUTES}, "pytorch": norm_router_scores_reference}
    for n, h in shapes:
        for name, fn in variants.items():
            row = {"rows": n, "hidden": h, "route": name}
            try:
                row.update(device_bench(n, h, GPU_BOTTLENECK, torch.bfloat16, torch.device("cuda"), roof, fn))
            except RuntimeError as err:
                row["error"] = str(err).splitlines()[0][:160]
                if not _is_refusal(err):
                    rows.append(row)
                    return {"ok": False, "roofline": roof, "rows": rows}
            rows.append(row)
    return {"ok": True, "roofline": roof, "rows": rows}


def group_bench_cli(out: Path) -> dict:
    cmd = [sys.executable, "-m", "tide_hf.cli", "bench", "kernels", "--dtype", "bfloat16", "--output", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=GROUP_TIMEOUT_S, check=False)
    return {"ok": proc.returncode == 0, "command": " ".join(cmd[1:]), "stdout": proc.stdout[-4000:],
            "stderr": proc.stderr[-2000:]}


def run_group(name: str, out: Path) -> dict:
    if name == "build":
        return group_build()
    if name.startswith("correct-"):
        return group_correct(name.removeprefix("correct-"))
    if name == "bench-cli":
        return group_bench_cli(out)
    return {"nonfinite": group_nonfinite, "poison": group_poison, "determinism": group_determinism,
            "gather-scatter": group_gather_scatter, "index-assert": group_index_assert,
            "bench-routes": group_bench_routes}[name]()


def worker(name: str, out: Path) -> None:
    try:
        result = run_group(name, out)
    except Exception as err:  # report, never crash the driver
        result = {"ok": False, "exception": f"{type(err).__name__}: {err}"[:2000],
                  "traceback": traceback.format_exc()[-4000:]}
    (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str))


def _bench_table(result: dict) -> str:
    roof = result.get("roofline", {})
    lines = [f"{roof.get('device_name')}: copy {roof.get('copy_gbps', 0):.0f} GB/s, bf16 matmul "
             f"{roof.get('matmul_tflops', 0):.0f} TFLOP/s",
             f"{'rows':>6} {'H':>5} {'route':>8} {'dev us':>8} {'host us':>8} {'GB/s':>7} {'copy%':>6} "
             f"{'TFLOP/s':>8} {'mm%':>5} {'bound':>7} {'roof%':>6} {'maxdiff':>8} timing"]
    for r in result.get("rows", []):
        if "error" in r:
            lines.append(f"{r['rows']:>6} {r['hidden']:>5} {r['route']:>8}  n/a: {r['error'][:70]}")
            continue
        lines.append(f"{r['rows']:>6} {r['hidden']:>5} {r['route']:>8} {r['device_us']:>8.1f} {r['host_us']:>8.1f} "
                     f"{r['gbps']:>7.0f} {r['copy_share']:>6.1%} {r['tflops']:>8.2f} {r['matmul_share']:>5.1%} "
                     f"{r['bound']:>7} {r['roofline_share']:>6.1%} {r['max_abs_diff']:>8.1e} {r['timing']}")
    return "\n".join(lines)


def _line(name: str, r: dict) -> str:
    status = "PASS" if r.get("ok") else "FAIL"
    detail = ""
    if "exception" in r:
        detail = r["exception"].splitlines()[0][:150]
    elif name.startswith("correct-"):
        detail = (f"cases {r['cases']}, refused {r['refused']}, max |diff| by dtype "
                  + ", ".join(f"{d} {v:.1e}" if v is not None else f"{d} -" for d, v in r["max_abs_by_dtype"].items())
                  + (f"; {r['n_failures']} failing, first: {r['failures'][:3]}" if r.get("failures") else ""))
    elif name == "build":
        detail = f"{r.get('device')} cc {r.get('capability')} torch {r.get('torch')} cuda {r.get('cuda')} " \
                 f"({r.get('seconds', 0):.0f} s) {r.get('error') or ''}"
    elif r.get("failures"):
        detail = f"{r.get('n_failures', len(r['failures']))} failing, first: {r['failures'][:3]}"
    return f"{status}  {name:<16} {detail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for the JSON results")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--groups", nargs="+", default=list(GROUPS), choices=GROUPS, help="groups to run")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        return worker(args.worker, args.out)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    summary = {}
    for name in args.groups:
        start = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--worker", name], env=env,
                                  cwd=REPO, capture_output=True, text=True, timeout=GROUP_TIMEOUT_S, check=False)
            path = args.out / f"{name}.json"
            result = json.loads(path.read_text()) if path.exists() else {
                "ok": False, "exception": f"worker exited {proc.returncode}: {proc.stderr.strip()[-500:]}"}
        except subprocess.TimeoutExpired:
            result = {"ok": False, "exception": f"timed out after {GROUP_TIMEOUT_S} s"}
        result["wall_s"] = time.perf_counter() - start
        summary[name] = result
        print(_line(name, result), flush=True)
    (args.out / "summary.json").write_text(json.dumps(
        {k: {"ok": v.get("ok"), "wall_s": v["wall_s"]} for k, v in summary.items()}, indent=2))
    if "bench-routes" in summary and summary["bench-routes"].get("rows"):
        print("\nRoutes, bf16, bottleneck 128 (device time from CUDA-graph replay, rotating inputs):")
        print(_bench_table(summary["bench-routes"]))
    if summary.get("bench-cli", {}).get("stdout"):
        print("\n`tide-hf bench kernels --dtype bfloat16` (written to OUT/kernels.{json,md}):")
        print(summary["bench-cli"]["stdout"].strip())
    failed = [k for k, v in summary.items() if not v.get("ok")]
    print("\nFAILED groups: " + ", ".join(failed) if failed else "\nALL PASS", flush=True)
    print(f"(total {sum(v['wall_s'] for v in summary.values()):.0f} s; JSON in {args.out})")


if __name__ == "__main__":
    main()
