"""The promotion gate: when a newly trained policy becomes @champion.

The evidence is paired: in the same pipeline run the candidate, its own SFT reference and the
current champion are evaluated on the same held-out problems with the same samples, and each
comparison is the paired difference of their correctness with a 95% interval
(grpo.eval.metrics.paired_difference). A candidate is promoted only when

1. it beats its own reference: the lower bound of (candidate - reference) is above 0, and
2. there is no champion yet, or the lower bound of (candidate - champion) is above
   `tracking.promotion_margin`.

A champion whose comparison is missing or NaN (it could not be evaluated) blocks promotion with
the reason recorded; `grpo promote` remains the manual override.
"""

from __future__ import annotations

import math
from typing import Any


def _finite(d: dict[str, float] | None) -> bool:
    return d is not None and all(math.isfinite(d.get(k, math.nan)) for k in ("diff", "ci_low"))


def decide(
    vs_reference: dict[str, float] | None,
    vs_champion: dict[str, float] | None,
    champion_version: str | None,
    margin: float,
    metric: str,
) -> tuple[bool, str]:
    """(promote?, the reason in one line) from paired differences {diff, ci_low, ci_high, n}.

    >>> decide({"diff": 0.1, "ci_low": 0.05}, None, None, 0.005, "synthetic")[0]
    True
    >>> ok, why = decide({"diff": 0.1, "ci_low": 0.05}, {"diff": 0.01, "ci_low": -0.02}, "3",
    ...                  0.005, "x")
    >>> ok, why.split(": ", 2)[2]
    (False, '+0.010, 95% lower bound -0.020 <= margin 0.005')
    """
    if not _finite(vs_reference):
        return False, f"{metric}: no paired comparison with its own reference"
    d, lo = vs_reference["diff"], vs_reference["ci_low"]
    if lo <= 0:
        return False, (
            f"{metric}: not better than its own reference: {d:+.3f}, 95% lower bound {lo:+.3f} <= 0"
        )
    if champion_version is None:
        return True, f"{metric}: first champion, beats its reference by {d:+.3f} (lower {lo:+.3f})"
    if not _finite(vs_champion):
        return False, (
            f"{metric}: champion v{champion_version}'s comparison is missing or NaN: refused "
            "(grpo promote overrides)"
        )
    d, lo = vs_champion["diff"], vs_champion["ci_low"]
    if lo <= margin:
        return False, (
            f"{metric}: within noise of or worse than champion v{champion_version}: {d:+.3f}, "
            f"95% lower bound {lo:+.3f} <= margin {margin:g}"
        )
    return True, (
        f"{metric}: beats champion v{champion_version} by {d:+.3f} "
        f"(95% lower bound {lo:+.3f} > margin {margin:g})"
    )


def tidy(v: float) -> str:
    """A number as a tag shows it: whole numbers without decimals, others to 4 decimal places
    (a bootstrap bound, not float noise).

    >>> tidy(1000.0), tidy(0.1000000015), tidy(4.34e-19), tidy(-0.08012), tidy(float("nan"))
    ('1000', '0.1', '0', '-0.0801', 'nan')
    """
    v = float(v)
    if v.is_integer():
        return str(int(v))
    return f"{round(v, 4) + 0.0:g}"  # + 0.0: -0.0 shown as 0


def evidence_tags(
    vs_reference: dict[str, float] | None, vs_champion: dict[str, float] | None
) -> dict[str, str]:
    """The comparisons as model-version tags (gate/vs_reference/diff, ...)."""
    out: dict[str, str] = {}
    for name, d in (("vs_reference", vs_reference), ("vs_champion", vs_champion)):
        for k, v in (d or {}).items():
            out[f"gate/{name}/{k}"] = tidy(v) if isinstance(v, float) else str(v)
    return out


def promotion_set(metric: str) -> str:
    """The held-out set of a promotion metric "eval/<set>/accuracy" (the config checks the form:
    the paired comparison is of greedy correctness, so the gate is defined for accuracy only)."""
    return metric.split("/")[1]


def describe(cfg_summary: dict[str, Any], table_md: str) -> str:
    """The model version's description: what was trained, from what, on what, and the result
    (the registry appends the gate's decision)."""
    s = cfg_summary
    if s.get("method", "grpo") == "rft":
        what = (
            f"RFT policy of run `{s['run_name']}`: {s['rounds']} rounds of rejection "
            f"sampling, at most {s['max_per_prompt']} correct completions a prompt."
        )
    else:
        what = (f"GRPO policy of run `{s['run_name']}`: {s['steps']} steps of {s['prompts']} "
                f"prompts x {s['group']} completions, loss {s['loss']}, lr {s['lr']:g}, beta "
                f"{s['beta']:g}.")  # fmt: skip
    lines = [
        what,
        f"Reference (pi_ref and the starting policy): `{cfg_summary['reference']}`.",
        f"Training data: {cfg_summary['data']}.",
        "",
        "Held-out evaluation (greedy pass@1, 95% intervals):",
        "",
        table_md,
    ]
    return "\n".join(lines)


def _comparison(d: dict[str, float] | None, need: str) -> str:
    if not _finite(d):
        return "not available"
    assert d is not None
    ok = d["ci_low"] > float(need)
    return (f"{d['diff']:+.3f} [{d['ci_low']:+.3f}, {d.get('ci_high', math.nan):+.3f}] "
            f"(lower bound must be > {float(need):g}: {'met' if ok else 'not met'})")  # fmt: skip


def decision_markdown(
    name: str,
    version: str,
    promoted: bool,
    reason: str,
    vs_reference: dict[str, float] | None,
    vs_champion: dict[str, float] | None,
    champion_version: str | None,
    margin: float,
    *,
    advice: bool | None = None,
) -> str:
    """The gate's decision and both paired comparisons, for where people look first: the
    version's description, the pipeline's parent run and the Prefect flow run; both comparisons
    are always there, whichever check failed first. With `advice`
    (tracking.promotion: approve) the version awaits a person, the gate's verdict advises."""
    aliases = "@champion and @challenger" if promoted else "@challenger"
    if advice is not None:  # tracking.promotion: approve; the gate only advises the approver
        verdict = (f"awaiting approval** ({aliases}). The gate advises "
                   f"{'for' if advice else 'against'} promotion:")  # fmt: skip
    else:
        verdict = f"{'promoted' if promoted else 'not promoted'}** ({aliases})."
    lines = [
        f"**{name} version {version}: {verdict} {reason}",
        "",
        f"- against its own SFT reference: {_comparison(vs_reference, '0')}",
    ]
    if champion_version is None:
        lines.append("- against the champion: there was none")
    else:
        lines.append(f"- against champion v{champion_version}: "
                     f"{_comparison(vs_champion, str(margin))}")  # fmt: skip
    return "\n".join(lines)
