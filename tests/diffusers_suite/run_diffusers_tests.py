#!/usr/bin/env python
"""Run diffusers' own tests of one model twice, stock and with pictor in every attention it serves, and compare.

    python tests/diffusers_suite/run_diffusers_tests.py --diffusers-tests PATH [--model MODEL]
        [--via processor|backend] [--backend pictor] [--out result.json]

PATH holds diffusers' `tests/` folder (a diffusers clone, or `git archive <tag> tests` unpacked), at the tag of
the installed diffusers. The targets (`TARGETS`): for `flux2` (the default)
`tests/models/transformers/test_models_transformer_flux2.py` and `tests/pipelines/flux2/`; for the other models
their model tests, `test_models_transformer_<model>.py` (`sd3`: SD3 and SD3.5; `cogvideox`: 1.0 and 1.5; `flux1`,
`qwenimage`, `wan`, `hunyuan_video`, `ltx`); their pipeline tests load text encoders from the hub.
Both runs load `pictor_diffusers.testing.hub_substitutes` (local tokenizers for the two hub ids the FLUX.2
pipeline tests fetch) with `HF_HUB_OFFLINE=1`. The second adds, `--via processor` (the default for flux2, sd3
and cogvideox), `pictor_diffusers.testing.diffusers_plugin` (`PictorAttn` in the processors;
`PICTOR_DIFFUSERS_PRECISION`, default fp32), or, `--via backend` (the default for the models on diffusers'
dispatcher), `pictor_diffusers.testing.backend_plugin` (`attention_backend(--backend)` around every test,
default "pictor").

Prints and writes JSON: per-run outcome counts; `regressions`, the tests that pass stock and fail with pictor
(training tests apart, in `training_regressions`: the kernels are inference-only); `fixed`, the reverse;
`stock_processor_calls`, any test in the PictorAttn run where a replaced diffusers processor still ran; how many
tests exercised pictor, the passing tests that ran no served attention, the skip reasons, and (backend runs) the
calls that fell back to native attention, with their reasons.
Exit status: 0 when there are no regressions outside training and no stock calls,
1 otherwise, 2 when the diffusers tests are missing or pytest could not run them.

An on-demand tool, not part of this repository's CI (which has neither diffusers' tests nor the hub).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

_MODEL_TESTS = "tests/models/transformers/test_models_transformer_{}.py"
_DISPATCHER_MODELS = (
    ("flux1", "flux"), ("qwenimage", "qwenimage"), ("wan", "wan"), ("hunyuan_video", "hunyuan_video"), ("ltx", "ltx")
)  # fmt: skip
TARGETS = {
    "flux2": (_MODEL_TESTS.format("flux2"), "tests/pipelines/flux2"),
    "sd3": (_MODEL_TESTS.format("sd3"),),
    "cogvideox": (_MODEL_TESTS.format("cogvideox"),),
    **{model: (_MODEL_TESTS.format(name),) for model, name in _DISPATCHER_MODELS},
}
HUB_PLUGIN = "pictor_diffusers.testing.hub_substitutes"
PICTOR_PLUGIN = "pictor_diffusers.testing.diffusers_plugin"
BACKEND_PLUGIN = "pictor_diffusers.testing.backend_plugin"
VIA = {"processor": PICTOR_PLUGIN, "backend": BACKEND_PLUGIN}
"""How the second run puts pictor in: `PictorAttn` in the processors (FLUX.2, SD3, CogVideoX: the default for
those models) or a pictor backend of diffusers' dispatcher (the default for the others)."""
PROCESSOR_MODELS = ("flux2", "sd3", "cogvideox")
TRAINING = re.compile(r"Training")  # diffusers' TrainingTesterMixin classes: TestSD3TransformerTraining, ...
REPO = Path(__file__).resolve().parents[2]
DEFAULT_ROOT = REPO / ".diffusers-tests"


def missing_message(root: Path, targets: tuple[str, ...]) -> str:
    return (
        f"diffusers' tests are not at {root} (need {', '.join(targets)}).\n"
        "Get them at the installed diffusers' tag, e.g.\n"
        "  git clone --depth 1 --branch v$(python -c 'import diffusers; print(diffusers.__version__)') "
        "https://github.com/huggingface/diffusers /tmp/diffusers\n"
        "and pass --diffusers-tests /tmp/diffusers (or unpack `git archive <tag> tests` into .diffusers-tests/)."
    )


def outcome(case: ET.Element) -> tuple[str, str]:
    """('passed' | 'failed' | 'error' | 'skipped', first line of the message) of one junit testcase."""
    for tag in ("failure", "error", "skipped"):
        child = case.find(tag)
        if child is not None:
            message = (child.get("message") or child.text or "").strip().splitlines()
            name = {"failure": "failed"}.get(tag, tag)
            return name, message[0][:300] if message else ""
    return "passed", ""


def read_junit(path: Path) -> dict[str, dict]:
    """test id -> {outcome, message, properties} from pytest's junit XML."""
    results: dict[str, dict] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        state, message = outcome(case)
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        previous = results.get(test)
        if previous is not None and previous["outcome"] != "passed" and state == "passed":
            continue  # a teardown entry after a failure keeps the failure
        results[test] = {"outcome": state, "message": message, "properties": properties}
    return results


def run_pytest(
    root: Path, junit: Path, plugin: str | None, precision: str, backend: str, targets: tuple[str, ...],
    extra: list[str],
) -> int:  # fmt: skip
    plugins = ["-p", HUB_PLUGIN] + (["-p", plugin] if plugin else [])
    command = [sys.executable, "-m", "pytest", "-c", os.devnull, "--rootdir", str(root), "-p", "no:cacheprovider"]
    command += [*plugins, "-q", "-rfE", f"--junitxml={junit}", *extra, *targets]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PICTOR_DIFFUSERS_PRECISION=precision, PICTOR_DIFFUSERS_BACKEND=backend)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    label = {None: "stock", PICTOR_PLUGIN: "PictorAttn", BACKEND_PLUGIN: f"backend {backend}"}[plugin]
    print(f"== {label}: {' '.join(command)}", file=sys.stderr, flush=True)
    return subprocess.run(command, cwd=root, env=env, stdout=sys.stderr, check=False).returncode  # stdout: the JSON


def compare(stock: dict[str, dict], pictor: dict[str, dict]) -> dict:
    def entry(test: str) -> dict:
        return {
            "test": test,
            "stock": stock.get(test, {}).get("outcome", "absent"),
            "pictor": pictor.get(test, {}).get("outcome", "absent"),
            "message": pictor.get(test, {}).get("message") or stock.get(test, {}).get("message", ""),
        }

    tests = sorted(set(stock) | set(pictor))
    regressed = [t for t in tests if stock.get(t, {}).get("outcome") == "passed"
                 and pictor.get(t, {}).get("outcome") != "passed"]  # fmt: skip
    fixed = [t for t in tests if pictor.get(t, {}).get("outcome") == "passed"
             and stock.get(t, {}).get("outcome") in ("failed", "error")]  # fmt: skip
    calls = {t: int(r["properties"].get("pictor_attn_calls", 0) or 0) for t, r in pictor.items()}
    stock_calls = {t: int(r["properties"].get("stock_calls", 0) or 0) for t, r in pictor.items()}
    skips = Counter(r["message"] for r in pictor.values() if r["outcome"] == "skipped")
    fallbacks = {t: int(r["properties"].get("fallback_calls", 0) or 0) for t, r in pictor.items()}
    listed = (r["properties"].get("fallback_reasons") or "" for r in pictor.values())
    reasons = Counter(reason for names in listed for reason in names.split(",") if reason)
    return {
        "counts": {
            "stock": dict(Counter(r["outcome"] for r in stock.values())),
            "pictor": dict(Counter(r["outcome"] for r in pictor.values())),
        },
        "regressions": [entry(t) for t in regressed if not TRAINING.search(t)],
        "training_regressions": [entry(t) for t in regressed if TRAINING.search(t)],
        "fixed": [entry(t) for t in fixed],
        "stock_processor_calls": sorted(t for t, n in stock_calls.items() if n),
        "tests_exercising_pictor": sum(n > 0 for n in calls.values()),
        "passed_exercising_pictor": sum(n > 0 and pictor[t]["outcome"] == "passed" for t, n in calls.items()),
        "passed_without_served_attention": sorted(
            t for t, n in calls.items() if not n and pictor[t]["outcome"] == "passed"
        ),
        "skip_reasons": dict(skips.most_common()),
        "fallback_calls": sum(fallbacks.values()),
        "tests_with_fallbacks": sorted(t for t, n in fallbacks.items() if n),
        "fallback_reasons": dict(reasons.most_common()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--diffusers-tests",
        type=Path,
        default=Path(os.environ.get("DIFFUSERS_TESTS", DEFAULT_ROOT)),
        help="folder holding diffusers' tests/ (default: $DIFFUSERS_TESTS, else .diffusers-tests/)",
    )
    parser.add_argument("--model", choices=sorted(TARGETS), default="flux2", help="whose tests (default: flux2)")
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    parser.add_argument("--via", choices=sorted(VIA), help="processor or backend (default: by model, see VIA)")
    parser.add_argument("--precision", default=os.environ.get("PICTOR_DIFFUSERS_PRECISION", "fp32"))
    parser.add_argument("--backend", default=os.environ.get("PICTOR_DIFFUSERS_BACKEND", "pictor"))
    parser.add_argument("pytest_args", nargs="*", help="passed to both pytest runs (after --), e.g. -k Klein")
    args = parser.parse_args(argv)

    root, targets = args.diffusers_tests.resolve(), TARGETS[args.model]
    if not all((root / target).exists() for target in targets):
        print(missing_message(root, targets), file=sys.stderr)
        return 2
    import diffusers

    with tempfile.TemporaryDirectory(prefix="pictor-diffusers-suite-") as tmp:
        junits = {mode: Path(tmp) / f"{mode}.xml" for mode in ("stock", "pictor")}
        via = args.via or ("processor" if args.model in PROCESSOR_MODELS else "backend")
        plugins = {"stock": None, "pictor": VIA[via]}
        codes = {
            mode: run_pytest(root, junits[mode], plugins[mode], args.precision, args.backend, targets, args.pytest_args)
            for mode in junits
        }
        if any(code not in (0, 1) or not junits[mode].exists() for mode, code in codes.items()):
            print(f"pytest did not complete a run (exit codes {codes})", file=sys.stderr)
            return 2
        stock, pictor = (read_junit(junits[mode]) for mode in ("stock", "pictor"))

    source = root / "SOURCE"
    result = {
        "diffusers_tests": str(root),
        "diffusers_tests_source": source.read_text().strip() if source.exists() else None,
        "diffusers_version": diffusers.__version__,
        "model": args.model,
        "via": via,
        **({"backend": args.backend} if via == "backend" else {"precision": args.precision}),
        **compare(stock, pictor),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 1 if result["regressions"] or result["stock_processor_calls"] else 0


if __name__ == "__main__":
    sys.exit(main())
