#!/usr/bin/env python
"""Compare the captured page bytes of two launcher receipts, kind by kind.

    python tools/compare_receipts.py runs/demo-qwen36-half/receipt.json runs/demo-qwen36/receipt.json \
        --expect-constant gdn_state conv_tail

Each receipt is a `runs/<run-name>/receipt.json` written by `examples/pretrain_gpt.py --longstraw`
(or its folder). The table has one row per page kind (`page_bytes_by_kind`, summed over ranks):
bytes in each run and their ratio next to the ratio of captured prompt tokens (P - 1), so a kind
whose bytes grow with the prompt shows the same ratio as the tokens and a fixed-size kind (the
receipt's `fixed_page_kinds`, e.g. Qwen3.6's GDN `gdn_state` and `conv_tail`) shows 1.00.
`--expect-constant KIND ...` turns the claim into a check: the exit status is 1 when any of those
kinds has different bytes in the two runs (or is missing from either), 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron_longstraw.training.receipts import format_table, human_bytes  # noqa: E402

REQUIRED = ("prompt_len", "page_bytes", "page_bytes_by_kind", "fixed_page_kinds")


def load_receipt(path: str | Path) -> dict:
    """A receipt (the file or its run folder), with the fields the comparison needs checked."""
    path = Path(path)
    if path.is_dir():
        path = path / "receipt.json"
    if not path.is_file():
        raise ValueError(f"{path}: no such receipt (runs/<run-name>/receipt.json).")
    try:
        receipt = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc}).") from exc
    missing = [k for k in REQUIRED if not isinstance(receipt, dict) or k not in receipt]
    if missing:
        raise ValueError(f"{path}: missing {missing}; receipts from before page bytes were recorded "
                         "per kind cannot be compared (run the launcher again).")
    receipt["path"] = str(path)
    return receipt


def compare(a: dict, b: dict, expect_constant: list[str] = ()) -> tuple[list[dict], list[str]]:
    """(one row per page kind, problems). A row: kind, bytes_a, bytes_b (None where a run lacks
    the kind), ratio b/a, fixed (a fixed-size kind in either receipt). A problem is a sentence for
    each kind of `expect_constant` whose bytes differ or are missing, and for runs of different
    families (their kinds are not comparable)."""
    problems = []
    if a.get("family") != b.get("family"):
        problems.append(f"the runs are of different families ({a.get('family')} and "
                        f"{b.get('family')}).")
    fixed = set(a["fixed_page_kinds"]) | set(b["fixed_page_kinds"])
    kinds = list(a["page_bytes_by_kind"]) + [k for k in b["page_bytes_by_kind"]
                                             if k not in a["page_bytes_by_kind"]]
    rows = []
    for kind in kinds:
        bytes_a, bytes_b = a["page_bytes_by_kind"].get(kind), b["page_bytes_by_kind"].get(kind)
        ratio = bytes_b / bytes_a if bytes_a and bytes_b is not None else None
        rows.append({"kind": kind, "bytes_a": bytes_a, "bytes_b": bytes_b, "ratio": ratio,
                     "fixed": kind in fixed})
    for kind in expect_constant:
        bytes_a, bytes_b = a["page_bytes_by_kind"].get(kind), b["page_bytes_by_kind"].get(kind)
        if bytes_a is None or bytes_b is None:
            where = " and ".join(r["path"] for r, n in ((a, bytes_a), (b, bytes_b)) if n is None)
            problems.append(f"{kind}: no such page kind in {where}.")
        elif bytes_a != bytes_b:
            problems.append(f"{kind}: {bytes_a} B at P={a['prompt_len']} but {bytes_b} B at "
                            f"P={b['prompt_len']}; expected the same bytes.")
    return rows, problems


def report(a: dict, b: dict, rows: list[dict], problems: list[str],
           expect_constant: list[str] = ()) -> str:
    """The printed comparison: a header, the per-kind table, a verdict line per check."""
    tokens_a, tokens_b = max(a["prompt_len"] - 1, 1), max(b["prompt_len"] - 1, 1)
    fmt = lambda n: "-" if n is None else human_bytes(n)  # noqa: E731
    table = [("kind", f"P={a['prompt_len']:<10} P={b['prompt_len']:<10} ratio")]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        table.append((r["kind"], f"{fmt(r['bytes_a']):<12} {fmt(r['bytes_b']):<12} {ratio}"
                                 + ("  fixed" if r["fixed"] else "")))
    table.append(("all pages", f"{fmt(a['page_bytes']):<12} {fmt(b['page_bytes']):<12} "
                               f"{b['page_bytes'] / max(a['page_bytes'], 1):.2f}"))
    lines = [f"page bytes: {a['path']} vs {b['path']} ({a.get('family')}; captured prompt tokens "
             f"x{tokens_b / tokens_a:.2f})", format_table(table)]
    if expect_constant:
        held = {r["kind"] for r in rows if r["bytes_a"] is not None and r["bytes_a"] == r["bytes_b"]}
        verdict = "yes" if set(expect_constant) <= held else "NO"
        lines.append(f"constant as the prompt grows ({', '.join(expect_constant)}): {verdict}")
    lines += [f"problem: {p}" for p in problems]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("receipt_a", help="receipt.json (or its run folder) of the shorter prompt")
    parser.add_argument("receipt_b", help="receipt.json (or its run folder) of the longer prompt")
    parser.add_argument("--expect-constant", nargs="+", default=[], metavar="KIND",
                        help="page kinds whose bytes must be equal in both runs (exit 1 if not)")
    args = parser.parse_args(argv)
    try:
        a, b = load_receipt(args.receipt_a), load_receipt(args.receipt_b)
    except ValueError as exc:
        sys.exit(f"compare_receipts.py: error: {exc}")
    rows, problems = compare(a, b, args.expect_constant)
    print(report(a, b, rows, problems, args.expect_constant))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
