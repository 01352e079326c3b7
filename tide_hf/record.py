"""A router's calibration record: where it came from (provenance) and what calibration measured (results), its
place in config.json, and the checks its results pass (the exit paths, the draft vocabulary's coverage).

config.json keeps the record in a section of its own (`RECORD_KEY`), apart from the architecture,
hyper-parameters and serving defaults at its top level. The config object holds every field flat, so code
reads `router.config.exit_paths` as before. A config.json without the section (written before it existed,
release 0.1.0 included) holds its record at the top level and loads as it is.
"""

from __future__ import annotations

from typing import Any

from .errors import TideArgumentError, TideArgumentTypeError, TideRouterFileError
from .values import check_int, check_real

RECORD_KEY = "calibration"  # config.json's section holding the record
SECTIONS = {
    # what the router was made from: the base model (checked at attach), the text and how it was sampled
    "provenance": ("base_model_name_or_path", "base_model_revision", "base_architecture", "base_model_type",
                   "base_fingerprint", "dataset", "unique_documents", "num_samples", "seq_len"),
    # what calibration measured: per-checkpoint metrics, the exit paths quality targets select from, the sizes of
    # the held-out scores the weights keep, the draft vocabulary's coverage, the seconds each stage took
    "results": ("metrics", "exit_paths", "held_out_tokens", "draft_vocab_coverage", "calibration_seconds"),
}
# Exit paths for quality targets (see `tide_hf.modeling.targets`): top-1 agreement, perplexity change.
PATH_KINDS = ("agreement", "perplexity")
CLOSED = 1.0  # a per-checkpoint threshold that never exits (every exit path starts with all of them closed)
SUMSQ_SLACK = 1e-9  # relative rounding a stored table's NLL sums may carry (fp64 sums written as JSON)
HELD_OUT_SPLITS = ("validation", "threshold")  # held_out_tokens' order: the ordering split, then the test split
RECORD_FIELDS = frozenset(name for names in SECTIONS.values() for name in names)


def nest_record(config: dict[str, Any]) -> dict[str, Any]:
    """`config` (flat, every field) with the record fields moved into their section, as config.json holds them."""
    record = {section: {name: config[name] for name in names if name in config}
              for section, names in SECTIONS.items()}
    return {**{key: value for key, value in config.items() if key not in RECORD_FIELDS}, RECORD_KEY: record}


def flatten_record(config: dict[str, Any]) -> dict[str, Any]:
    """`config` (config.json's dict) with its record section laid flat; a config.json without the section is
    returned as it is. A section that is not one, an unknown key in it, or a field given twice (in the section
    and at the top level) is a `TideRouterFileError`: a misspelled result must not load as an empty one."""
    if RECORD_KEY not in config:
        return config
    config = dict(config)
    record = config.pop(RECORD_KEY)
    where = f"TIDE router config: {RECORD_KEY!r}"
    if not isinstance(record, dict) or set(record) - set(SECTIONS):
        raise TideRouterFileError(f"{where} must be an object with the sections {sorted(SECTIONS)}, got "
                                  f"{sorted(record) if isinstance(record, dict) else record!r}")
    for section, names in SECTIONS.items():
        values = record.get(section, {})
        if not isinstance(values, dict):
            raise TideRouterFileError(f"{where}[{section!r}] must be an object, got {values!r}")
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise TideRouterFileError(f"{where}[{section!r}] holds {unknown}, not among its fields {list(names)}")
        twice = sorted(set(values) & set(config))
        if twice:
            raise TideRouterFileError(f"{where}[{section!r}] and the top level both hold {twice}; a field "
                                      "belongs to one place")
        config.update(values)
    return config


def check_coverage(coverage: Any) -> None:
    """`draft_vocab_coverage`: a dict of positive integer sizes (as strings, JSON keys) to shares in [0, 1]."""
    if not isinstance(coverage, dict):
        raise TideArgumentTypeError(f"draft_vocab_coverage must be a dict of size -> coverage, got {coverage!r}")
    for size, share in coverage.items():
        if not (isinstance(size, str) and size.isdigit() and int(size) >= 1):
            raise TideArgumentError(f"draft_vocab_coverage: sizes must be positive integers written as strings, "
                                    f"got {size!r}")
        check_real(f"draft_vocab_coverage[{size!r}]", share, low=0.0, high=1.0)


def check_held_out_tokens(value: Any) -> None:
    """`held_out_tokens`: None (no held-out scores kept) or [validation tokens, threshold tokens], the rows of the
    held-out matrices the weights keep (`TideRouter.held_out`)."""
    if value is None:
        return
    if not isinstance(value, (list, tuple)) or len(value) != len(HELD_OUT_SPLITS):
        raise TideArgumentTypeError(f"held_out_tokens must be None or a list of two token counts "
                                    f"[{', '.join(HELD_OUT_SPLITS)}], got {value!r}")
    for name, count in zip(HELD_OUT_SPLITS, value):
        check_int(f"held_out_tokens ({name})", count, minimum=0)


def check_exit_paths(paths: Any, num_checkpoints: int) -> None:
    """`exit_paths`: per kind in `PATH_KINDS`, threshold vectors (one per checkpoint, in [0, 1], the first all
    closed: "no exit" is where a test starts) and, per vector, the held-out losses `select` tests."""
    if not isinstance(paths, dict):
        raise TideArgumentTypeError(f"exit_paths must be a dict of kind -> path, got {type(paths).__name__}")
    for kind, path in paths.items():
        name = f"exit_paths[{kind!r}]"
        if kind not in PATH_KINDS:
            raise TideArgumentError(f"exit_paths: kinds must be among {PATH_KINDS}, got {kind!r}")
        if not isinstance(path, dict):
            raise TideArgumentTypeError(f"{name} must be a dict, got {type(path).__name__}")
        missing = {"thresholds", "errors", "n", "nll_sum", "nll_sumsq", "n_next"} - set(path)
        if missing:
            raise TideArgumentError(f"{name} lacks {sorted(missing)}")
        points = path["thresholds"]
        if not isinstance(points, list) or not points:
            raise TideArgumentError(f"{name}['thresholds'] must be a non-empty list of threshold vectors")
        for point in points:
            if not isinstance(point, list) or len(point) != num_checkpoints:
                raise TideArgumentError(f"{name}: every threshold vector needs one value per checkpoint "
                                        f"({num_checkpoints}), got {point!r}")
            for value in point:
                check_real(f"{name} threshold", value, low=0.0, high=1.0)
        if any(value != CLOSED for value in points[0]):
            raise TideArgumentError(f"{name}: the first threshold vector must close every checkpoint (all "
                                    f"{CLOSED}), got {points[0]}")
        check_int(f"{name}['n']", path["n"], minimum=0)
        check_int(f"{name}['n_next']", path["n_next"], minimum=0)
        for key in ("errors", "nll_sum", "nll_sumsq"):
            if not isinstance(path[key], list) or len(path[key]) != len(points):
                raise TideArgumentError(f"{name}[{key!r}] must be a list with one entry per threshold vector "
                                        f"({len(points)})")
        for errors in path["errors"]:
            check_int(f"{name} errors", errors, minimum=0)
            if errors > path["n"]:
                raise TideArgumentError(f"{name}: {errors} errors out of n={path['n']} tokens")
        for value in path["nll_sum"] + path["nll_sumsq"]:
            check_real(f"{name} NLL sums", value)
        check_path_sizes(name, path)
    sizes = {(path["n"], path["n_next"]) for path in paths.values()}
    if len(sizes) > 1:
        raise TideArgumentError(f"exit_paths: every kind is tested on the same threshold split, but their (n, "
                                f"n_next) differ: {sorted(sizes)}")


def check_path_sizes(name: str, path: dict) -> None:
    """Losses a held-out test could have produced: at most `n` tokens with a next token, nothing lost where
    nothing exits (the first point), sums of squares that are non-negative and at least the square of the sum
    over `n_next` (Cauchy-Schwarz, up to rounding)."""
    if path["n_next"] > path["n"]:
        raise TideArgumentError(f"{name}: n_next={path['n_next']} tokens with a next token out of n={path['n']}")
    if path["errors"][0] or path["nll_sum"][0] or path["nll_sumsq"][0]:
        raise TideArgumentError(f"{name}: the first point closes every checkpoint, so its losses must be 0, got "
                                f"errors {path['errors'][0]}, NLL sums {path['nll_sum'][0]}, {path['nll_sumsq'][0]}")
    for total, squares in zip(path["nll_sum"], path["nll_sumsq"]):
        if squares < 0 or total * total > squares * max(path["n_next"], 1) * (1 + SUMSQ_SLACK) + SUMSQ_SLACK:
            raise TideArgumentError(f"{name}: NLL sum {total} and sum of squares {squares} over n_next="
                                    f"{path['n_next']} tokens are impossible (sum^2 > n_next * sum of squares)")
