"""tide_hf.kernels: the JIT-built C++ (and, on a GPU, CUDA) kernels against the PyTorch reference.

The first test run compiles `cuda/tide_cpu.cpp` (about a minute on two cores); later runs load the cached build.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tide_hf import kernels
from tide_hf.kernels import NormSpec, gather_rows, norm_router_scores, norm_router_scores_reference, norm_spec
from tide_hf.kernels import build as kernel_build

# Kernel vs reference, |score difference| (scores lie in [0, 1]). Max over a test: fp32 differs only in summation
# order (3e-7 seen); in fp16 / bf16 a normalised element now and then rounds one ulp differently (up to ~3e-5
# seen over 5,000 random cases when it hits an outlier channel). Median: most rows agree bit for bit, while a
# misplaced dtype rounding in the norm moves every row (median >= 6e-6 fp16, >= 3e-5 bf16), so it is caught here.
SCORE_ATOL = {torch.float32: 2e-6, torch.float16: 1e-4, torch.bfloat16: 2e-4}
MEDIAN_ATOL = 1e-6
DTYPES = tuple(SCORE_ATOL)
ROWS = (1, 3, 17)  # 1 and 3 take the blocked-dot route, 17 the GEMM route of the CPU kernel
HIDDEN = (64, 576, 1000)  # 1000: not a multiple of 128 (nor of the 16-wide vector loop)
BOTTLENECK = (16, 128)
KINDS = ("rms", "rms_gemma", "rms_fp32", "layernorm", "none")
CACHED_LOAD_MAX_S = 30.0  # a cached load is ninja's no-op check plus dlopen; a rebuild takes about a minute
SUBPROCESS_TIMEOUT_S = 600
COPY_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool)
REPO = Path(__file__).resolve().parent.parent

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ("cpu", pytest.param("cuda", marks=cuda_only))


@pytest.fixture(scope="module")
def cpu_kernels() -> None:
    """Build (first run) or load (cached) the CPU extension once; a failed build fails the tests here."""
    if kernels.active_backend("cpu") == "pytorch":
        reason = kernels.kernel_build_error("cpu") or f"{kernels.ENV_NO_KERNELS} is set"
        if "build failed" in reason:
            pytest.fail(f"CPU extension did not build: {reason}")
        pytest.skip(f"no CPU kernels here: {reason}")


def _inputs(kind: str, n: int, h: int, b: int, dtype: torch.dtype, device: str, seed: int):
    """Fresh random router + norm + hidden rows; hidden has LLM-like outlier channels."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen) * 2
    hidden[:, : max(1, h // 64)] *= 20
    weight = torch.randn(h, generator=gen) * 0.2 + (0.0 if kind == "rms_gemma" else 1.0)
    bias = torch.randn(h, generator=gen) * 0.1
    # nn.Linear's default init (uniform in +-1/sqrt(fan_in)), drawn from `gen`
    shapes = (((b, h), h), ((b,), h), ((1, b), b), ((1,), b))
    router = [((torch.rand(s, generator=gen) * 2 - 1) / fan_in**0.5).to(device) for s, fan_in in shapes]
    spec = NormSpec(kind, weight.to(device, dtype), bias.to(device, dtype) if kind == "layernorm" else None, 1e-5)
    return hidden.to(device, dtype), spec, router


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b", BOTTLENECK)
@pytest.mark.parametrize("h", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_router_scores_match_reference(dtype: torch.dtype, h: int, b: int, device: str) -> None:
    assert kernels.active_backend(device) == ("cpp" if device == "cpu" else "cuda")
    for kind in KINDS:
        errors = []
        for n in ROWS:
            seed = zlib.crc32(f"{n} {h} {b} {kind} {dtype}".encode())
            hidden, spec, router = _inputs(kind, n, h, b, dtype, device, seed)
            with torch.inference_mode():
                got = norm_router_scores(hidden, spec, *router)
                want = norm_router_scores_reference(hidden, spec, *router)
            assert got.dtype == torch.float32 and got.shape == (n,)
            errors.append((got - want).abs())
        err = torch.cat(errors)
        assert err.max() <= SCORE_ATOL[dtype], f"{kind}: max |diff| {err.max():.2e} > {SCORE_ATOL[dtype]:.0e}"
        assert err.median() <= MEDIAN_ATOL, f"{kind}: median |diff| {err.median():.2e}: dtype handling differs"


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("device", DEVICES)
def test_norm_router_scores_layouts_and_mixed_dtypes(device: str) -> None:
    """Strided / 3-D hidden, fp32 norm weight on bf16 rows (no product rounding), missing affine params."""
    hidden, spec, router = _inputs("rms", 12, 192, 32, torch.bfloat16, device, seed=1)
    cases = [
        (hidden.view(3, 4, 192), spec),
        (hidden[:, ::2], NormSpec("rms", spec.weight[::2], None, 1e-5)),
        (hidden, NormSpec("rms", spec.weight.float(), None, 1e-5)),
        (hidden, NormSpec("rms", None, None, 1e-5)),
        (hidden, NormSpec("layernorm", None, None, 1e-5)),
    ]
    for rows, norm in cases:
        r = [router[0][:, : rows.shape[-1]].contiguous(), *router[1:]]
        with torch.inference_mode():
            got, want = norm_router_scores(rows, norm, *r), norm_router_scores_reference(rows, norm, *r)
        assert got.shape == rows.shape[:-1]
        torch.testing.assert_close(got, want, rtol=0, atol=SCORE_ATOL[torch.bfloat16])


def test_autograd_inputs_use_pytorch() -> None:
    hidden, spec, router = _inputs("rms", 2, 64, 16, torch.float32, "cpu", seed=2)
    router[0].requires_grad_(True)
    norm_router_scores(hidden, spec, *router).sum().backward()
    assert router[0].grad is not None


def _hf_norms() -> list[nn.Module]:
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    torch.manual_seed(3)
    norms = [LlamaRMSNorm(96, eps=1e-6), GemmaRMSNorm(96, eps=1e-6), Olmo2RMSNorm(96, eps=1e-6)]
    modules = [*norms, nn.LayerNorm(96, eps=1e-5), nn.Identity()]
    for module in modules:
        for p in module.parameters():
            p.data.normal_(0.5, 0.3)
    return modules


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_equals_hf_module_then_mlp(dtype: torch.dtype) -> None:
    fc1, fc2 = nn.Linear(96, 24), nn.Linear(24, 1)
    hidden = torch.randn(5, 96, dtype=dtype) * 3
    for module in _hf_norms():
        module.to(dtype)
        spec = norm_spec(module)
        assert spec is not None, type(module).__name__
        with torch.no_grad():
            want = torch.sigmoid(fc2(F.relu(fc1(module(hidden).float())))).squeeze(-1)
            got = norm_router_scores_reference(hidden, spec, fc1.weight, fc1.bias, fc2.weight, fc2.bias)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{type(module).__name__} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_norm_spec_recognises_final_norms(dtype: torch.dtype) -> None:
    import importlib

    expected = {
        "llama.LlamaRMSNorm": "rms", "mistral.MistralRMSNorm": "rms", "qwen2.Qwen2RMSNorm": "rms",
        "qwen3.Qwen3RMSNorm": "rms", "phi3.Phi3RMSNorm": "rms", "gemma.GemmaRMSNorm": "rms_gemma",
        "gemma2.Gemma2RMSNorm": "rms_gemma", "gemma3.Gemma3RMSNorm": "rms_gemma",
        "qwen3_next.Qwen3NextRMSNorm": "rms_gemma",  # (1 + w) without Gemma in the name: found by the probe
        "olmo2.Olmo2RMSNorm": "rms_fp32", "gpt_oss.GptOssRMSNorm": "rms_fp32",  # (w * x) in fp32, then cast
    }  # fmt: skip
    for path, kind in expected.items():
        family, name = path.split(".")
        module = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)(64)
        nn.init.normal_(module.weight, 0.1, 0.2)
        spec = norm_spec(module.to(dtype))
        fp32_same = kind == "rms_fp32" and dtype == torch.float32  # no rounding step: rms and rms_fp32 coincide
        assert spec is not None and spec.kind == ("rms" if fp32_same else kind), (path, spec)
        assert spec.weight is module.weight and spec.eps == pytest.approx(1e-6)
    assert norm_spec(nn.LayerNorm(64)).kind == "layernorm"
    assert norm_spec(nn.Identity()).kind == "none"
    assert norm_spec(nn.Linear(4, 4)) is None


def test_norm_spec_rejects_unknown_formulas() -> None:
    class OddRMSNorm(nn.Module):  # named like an RMSNorm, computes something else
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(32)), 1e-6

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    assert norm_spec(OddRMSNorm()) is None
    with torch.device("meta"):
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        assert norm_spec(LlamaRMSNorm(32)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_norm_spec_confirms_layernorm_subclasses_on_the_probe(dtype: torch.dtype) -> None:
    """An nn.LayerNorm subclass is LayerNorm only if it computes it: Nemotron's LayerNorm1P scales by (1 + w) and
    was read as LayerNorm with weight w (wrong router scores, wrong fused K/V); a plain subclass still qualifies."""
    from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P

    class RenamedLayerNorm(nn.LayerNorm):  # same formula under another name
        pass

    for module in (nn.LayerNorm(64), RenamedLayerNorm(64), NemotronLayerNorm1P(64)):
        nn.init.normal_(module.weight, 0.5, 0.3)
        nn.init.normal_(module.bias, 0.0, 0.3)
        spec = norm_spec(module.to(dtype))
        if isinstance(module, NemotronLayerNorm1P):
            assert spec is None
        else:
            assert spec is not None and spec.kind == "layernorm" and spec.weight is module.weight
    assert norm_spec(nn.LayerNorm(64, elementwise_affine=False)).kind == "layernorm"


def test_nemotron_is_scored_on_its_own_final_norm() -> None:
    """Serving scores a checkpoint on the model's final norm, the representation calibration trains routers on
    (reference: the router MLP applied by hand to `model.model.norm(h)`)."""
    import transformers as tf

    import tide_hf

    torch.manual_seed(0)
    model = tf.NemotronForCausalLM(tf.NemotronConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=9, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)).eval()
    with torch.no_grad():
        model.model.norm.weight.normal_(0.5, 0.3)
    router = tide_hf.TideRouter(tide_hf.TideRouterConfig(hidden_size=64, num_hidden_layers=9, router_bottleneck_dim=8,
                                                         exit_head="lens"))
    hidden = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1)) * 3
    with tide_hf.attach(model, router, exit_threshold=1.0, ignore_fingerprint=True,
                        mode="select") as handle, torch.no_grad():
        got = handle.score(4, hidden)
        mlp = router.routers["4"]
        want = torch.sigmoid(mlp.fc2(F.relu(mlp.fc1(model.model.norm(hidden).float())))).squeeze(-1)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", COPY_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(9, 40), (9, 3, 5), (9,)], ids=str)
def test_gather_scatter_write_every_row(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> None:
    n = shape[0]
    x = (torch.randn(shape) * 100).to(device, dtype)
    poison = torch.full(shape, float("nan") if dtype.is_floating_point else 7, device=device).to(dtype)
    perm = torch.randperm(n, device=device)
    index = torch.tensor([4, 0, 8, 4, 2], device=device)  # duplicates allowed in a gather
    expected = x.index_select(0, index)
    stale = poison[: len(index)].clone()
    del stale  # a poisoned block back to the allocator: the gather's output (same size) likely reuses it
    assert torch.equal(gather_rows(x, index), expected)
    assert torch.equal(gather_rows(x.transpose(0, -1).contiguous().transpose(0, -1), index), x[index])
    assert gather_rows(x, index[:0]).shape == (0, *shape[1:])
    # scatter a permutation into a poisoned buffer: every row must be overwritten
    dst = poison.clone()
    assert kernels.scatter_rows_(dst, perm, x) is dst
    assert torch.equal(dst, torch.empty_like(x).index_copy_(0, perm, x))
    # partial scatter leaves the other rows alone
    dst = poison.clone()
    kernels.scatter_rows_(dst, index[1:3], x[:2])
    assert torch.equal(dst[index[1:3]], x[:2])
    mask = torch.ones(n, dtype=torch.bool, device=device)
    mask[index[1:3]] = False
    assert torch.equal(dst[mask].view(torch.uint8), poison[mask].view(torch.uint8))


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", (1, 17, 300))  # CPU: blocked dots, GEMM; CUDA: small route, tensor cores (2 tiles)
def test_nonfinite_hidden_gives_nan_score(device: str, n: int, dtype: torch.dtype) -> None:
    """A NaN or inf hidden state scores NaN in every backend and dtype (fmaxf(NaN, 0) = 0 once turned it into
    sigmoid(b2) on CUDA): a broken state must never reach the exit threshold."""
    for kind in KINDS:
        hidden, spec, router = _inputs(kind, n, 72, 16, dtype, device, seed=3)
        router[3].fill_(30.0)  # a large b2: a dropped NaN would score ~1.0
        hidden[0, 5] = float("nan")
        hidden[-1, 7] = float("inf")
        for fn in (norm_router_scores, norm_router_scores_reference):
            scores = fn(hidden, spec, *router)
            assert scores[0].isnan(), (fn.__name__, kind)
            if kind != "none":  # an inf before a norm is NaN after it; without a norm it may saturate
                assert scores[-1].isnan(), (fn.__name__, kind)
            assert scores[1:-1].isfinite().all() if n > 2 else True


@pytest.mark.usefixtures("cpu_kernels")
def test_gather_scatter_check_indices() -> None:
    x = torch.zeros(4, 3)
    with pytest.raises((IndexError, RuntimeError)):
        gather_rows(x, torch.tensor([4]))
    with pytest.raises((IndexError, RuntimeError)):
        kernels.scatter_rows_(x, torch.tensor([-1]), torch.ones(1, 3))
    with pytest.raises(IndexError, match="out of range"):  # raised in Python, before the extension reads it
        kernels.scatter_rows_(x, torch.tensor([0, 9]), torch.ones(2, 3))
    strided = torch.zeros(3, 4).t()  # not contiguous: PyTorch path, same result
    kernels.scatter_rows_(strided, torch.tensor([1]), torch.ones(1, 3))
    assert strided[1].eq(1).all() and strided.sum() == 3
    rows = torch.arange(12.0).reshape(4, 3)  # src a view of dst: the extension copied rows it had overwritten
    with pytest.raises(RuntimeError, match="single memory location"):  # PyTorch's refusal, as without kernels
        kernels.scatter_rows_(rows, torch.tensor([1, 2]), rows[0:2])


def _python(code: str, **env: str) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON line."""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=REPO,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.usefixtures("cpu_kernels")
def test_second_load_uses_the_cache() -> None:
    ext_file = Path(kernel_build.extension("cpu").__file__)
    build_dir = ext_file.parent
    before = {p.name: p.stat().st_mtime_ns for p in build_dir.iterdir() if p.suffix in (".so", ".o", ".pyd")}
    ninja_log = (build_dir / ".ninja_log").read_text() if (build_dir / ".ninja_log").exists() else None
    out = _python(
        "import json, time; from tide_hf import kernels; from tide_hf.kernels import build as kernel_build; "
        "t = time.perf_counter(); "
        "ok = kernels.active_backend('cpu') != 'pytorch'; s = time.perf_counter() - t; "
        "print(json.dumps({'ok': ok, 's': s, 'file': kernel_build.extension('cpu').__file__}))"
    )
    assert out["ok"] and Path(out["file"]) == ext_file
    assert out["s"] < CACHED_LOAD_MAX_S, f"cached load took {out['s']:.1f}s: rebuilt?"
    after = {p.name: p.stat().st_mtime_ns for p in build_dir.iterdir() if p.suffix in (".so", ".o", ".pyd")}
    assert after == before, "the second load recompiled"
    if ninja_log is not None:
        assert (build_dir / ".ninja_log").read_text() == ninja_log


def test_env_var_forces_pytorch() -> None:
    out = _python(
        "import json, torch; from tide_hf import kernels as k; "
        "h = torch.randn(3, 64); s = k.NormSpec('rms', torch.ones(64), None, 1e-6); "
        "r = [torch.randn(8, 64), torch.randn(8), torch.randn(1, 8), torch.randn(1)]; "
        "same = torch.equal(k.norm_router_scores(h, s, *r), k.norm_router_scores_reference(h, s, *r)); "
        "print(json.dumps({'backend': k.active_backend('cpu'), 'avail': k.active_backend('cpu') != 'pytorch', "
        "'tried': k.kernel_build_error('cpu'), 'same': same}))",
        TIDE_HF_NO_KERNELS="1",
    )
    assert out == {"backend": "pytorch", "avail": False, "tried": None, "same": True}



def test_env_var_values_mean_what_they_say(monkeypatch: pytest.MonkeyPatch) -> None:
    """`TIDE_HF_NO_KERNELS=false` (or `no`) turned the kernels off: any value but "" or "0" did."""
    for value, disabled in (("1", True), ("TRUE", True), ("yes", True), ("0", False), ("false", False),
                            ("No", False), ("", False)):
        monkeypatch.setenv(kernel_build.ENV_NO_KERNELS, value)
        assert kernel_build.kernels_disabled() is disabled, value
    monkeypatch.setenv(kernel_build.ENV_NO_KERNELS, "maybe")
    with pytest.raises(ValueError, match="TIDE_HF_NO_KERNELS='maybe': use 1 .* or 0"):
        kernel_build.extension("cpu")

@pytest.fixture
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_build, "_extensions", {})
    monkeypatch.setattr(kernel_build, "_build_errors", {})


def test_build_failure_warns_once_and_falls_back(
    fresh_state: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "broken.cpp").write_text("#error deliberately broken\n")
    monkeypatch.setattr(kernel_build, "KERNEL_DIR", tmp_path)
    monkeypatch.setattr(kernel_build, "EXTENSIONS", {"cpu": ("tide_hf_test_broken", ("broken.cpp",))})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    hidden, spec, router = _inputs("rms", 2, 64, 16, torch.float32, "cpu", seed=4)
    with caplog.at_level(logging.WARNING, logger="tide_hf.kernels"):
        for _ in range(2):
            with torch.inference_mode():
                scores = norm_router_scores(hidden, spec, *router)
    assert torch.equal(scores, norm_router_scores_reference(hidden, spec, *router))
    assert kernels.active_backend("cpu") == "pytorch"
    assert "build failed" in kernels.kernel_build_error("cpu")
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_missing_compiler_falls_back(fresh_state: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "tide-hf-no-such-compiler")
    assert kernels.active_backend("cpu") == "pytorch"
    assert "no C++ compiler" in kernels.kernel_build_error("cpu")
    assert torch.equal(gather_rows(torch.arange(6).view(3, 2), torch.tensor([2])), torch.tensor([[4, 5]]))


def test_concurrent_first_use_builds_once(fresh_state: None, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def slow_build(flavour: str) -> object:
        calls.append(flavour)
        time.sleep(0.2)
        return object()

    monkeypatch.setattr(kernel_build, "_build", slow_build)
    monkeypatch.setattr(kernel_build, "_toolchain_missing", lambda flavour: None)
    threads = [threading.Thread(target=kernels.active_backend, args=("cpu",)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["cpu"]


def test_a_background_build_is_the_one_first_use_waits_for(fresh_state: None, monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """The demo starts the build before calibrating: the caller goes on while the compiler runs, and its first
    kernel call waits for that build (no second one)."""
    calls, built, running, release = [], object(), threading.Event(), threading.Event()

    def held_build(flavour: str) -> object:
        calls.append(flavour)
        running.set()
        release.wait(10)  # the build runs until the test lets it finish
        return built

    monkeypatch.setattr(kernel_build, "_build", held_build)
    monkeypatch.setattr(kernel_build, "_toolchain_missing", lambda flavour: None)
    thread = kernels.build_in_background("cpu")
    assert running.wait(10) and thread.is_alive() and thread.daemon  # returned while the build still runs
    release.set()
    assert kernel_build.extension("cpu") is built and calls == ["cpu"]
    thread.join()
    assert calls == ["cpu"]


def test_a_lock_left_by_a_killed_build_is_removed_and_a_live_one_waited_for(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A build killed mid-way leaves torch's `lock`: every later process waited for it forever. A build that
    still writes files is alive, however old its lock."""
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(kernel_build, "BUILD_SECONDS", {"cpu": 0.5})  # a dead build is seen within 0.5 s
    lock = Path(_get_build_directory("tide_hf_test_lock", verbose=False)) / "lock"
    lock.write_text("")
    old = time.time() - kernel_build.STALE_LOCK_FACTOR * kernel_build.BUILD_SECONDS["cpu"] - 60
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger="tide_hf.kernels"):
        kernel_build._wait_for_other_build("tide_hf_test_lock", "cpu")
    assert not lock.exists() and "has done nothing for" in caplog.text
    caplog.clear()
    lock.write_text("")  # a build running in another process (old lock, fresh output): waited for until it is done
    os.utime(lock, (old, old))
    (lock.parent / "tide.o").write_text("")
    remover = threading.Timer(1.0, lock.unlink)
    remover.start()
    started = time.perf_counter()
    kernel_build._wait_for_other_build("tide_hf_test_lock", "cpu")
    remover.join()
    assert time.perf_counter() - started >= 0.9 and not caplog.text


@pytest.mark.usefixtures("cpu_kernels")
def test_microbench_reports_both_paths() -> None:
    from tide_bench.kernels import microbench

    (row,) = microbench([(2, 64, 16)], torch.float32, "cpu")
    assert row["backend"] == "cpp" and row["kernel_us"] > 0 and row["torch_us"] > 0
    assert row["max_abs_diff"] <= SCORE_ATOL[torch.float32] and row["kernel_gbps"] > 0


def test_format_kernels_places_gpu_rows_on_the_roofline() -> None:
    """GPU results carry the measured roofline: the table shows device and host time, shares as percentages,
    and the bound; CPU results (the committed README table) keep their columns."""
    from tide_bench.tables import format_kernels

    gpu = {"rows": 4096, "hidden": 4096, "bottleneck": 128, "dtype": "bfloat16", "device": "cuda",
           "backend": "cuda", "device_name": "NVIDIA H100", "copy_gbps": 3000.0, "matmul_tflops": 700.0,
           "timing": "cuda-graph", "kernel_us": 20.0, "kernel_host_us": 9.5, "torch_us": 500.0, "speedup": 25.0,
           "kernel_gbps": 1500.0, "copy_share": 0.5, "kernel_tflops": 0.25, "matmul_share": 0.000357,
           "bound": "memory", "roofline_share": 0.5}
    table = format_kernels({"rows": [gpu]})
    assert table.startswith("NVIDIA H100: copy 3000 GB/s, bf16 matmul 700 TFLOP/s")
    assert "| 4096 | 4096 | bfloat16 | 20.0 | 9.5 | 500.0 | 25.0 | 1500.0 | 50.0% | 0.25 | 0.0% | memory | 50.0% |" \
        in table
    cpu = {k: gpu[k] for k in ("rows", "hidden", "bottleneck", "dtype", "backend", "kernel_us", "torch_us", "speedup")}
    header, _, line = format_kernels({"rows": [cpu]}).splitlines()
    assert line == "| 4096 | 4096 | 128 | bfloat16 | cuda | 20.0 | 500.0 | 25.0 |" and "copy_share" not in header


@cuda_only
def test_cuda_large_rows_and_hidden() -> None:
    """The GEMM route (many rows) and a row too large for shared memory."""
    for n, h in ((80, 1024), (2, 65536)):
        hidden, spec, router = _inputs("rms", n, h, 64, torch.bfloat16, "cuda", seed=5)
        with torch.inference_mode():
            got = norm_router_scores(hidden, spec, *router)
            want = norm_router_scores_reference(hidden, spec, *router)
        torch.testing.assert_close(got, want, rtol=0, atol=SCORE_ATOL[torch.bfloat16])


@cuda_only
@pytest.mark.parametrize("route", ("small", "tensor", "gemm"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_every_route_matches_reference(route: str, dtype: torch.dtype) -> None:
    """Each CUDA route forced on (auto picks one per shape, so the others would go untested); a route that
    cannot take an input (small: > 64 rows, tensor: fp32 rows or > 128 units) refuses it with an error."""
    from tide_bench.kernels import path_fn

    fn, ran = path_fn(route), 0
    for kind in KINDS:
        for n, h, b in ((1, 1003, 128), (8, 72, 48), (40, 576, 128), (300, 1003, 16), (130, 4096, 200)):
            hidden, spec, router = _inputs(kind, n, h, b, dtype, "cuda", seed=zlib.crc32(f"{route}{n}{kind}".encode()))
            with torch.inference_mode():
                try:
                    got = fn(hidden, spec, *router)
                except RuntimeError as err:
                    assert "route" in str(err), err
                    continue
                want = norm_router_scores_reference(hidden, spec, *router)
            torch.testing.assert_close(got, want, rtol=0, atol=SCORE_ATOL[dtype], msg=f"{route} {kind} {n}x{h}x{b}")
            ran += 1
    assert ran > 0
