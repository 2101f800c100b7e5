"""Which decoder a run evaluated, as its row says it: the drafter family and its decoding (a DFlash block of B, an
EAGLE-3 chain of K or EAGLE's tree total_token,depth,top_k), from results.json's drafter / comparability records.
The comparison table gets the column when an EAGLE-3 run is among the runs (headline when families mix)."""
from __future__ import annotations

FAMILY_NAMES = {"dflash": "DFlash", "eagle3": "EAGLE-3"}


def family_of(res) -> str:
    """`dflash` or `eagle3`; a file from before families were recorded is DFlash's."""
    return res.drafter.family or res.comparability.family or "dflash"


def decoding_text(res) -> str:
    """'DFlash block 16', 'EAGLE-3 chain 5', 'EAGLE-3 tree 60,7,10' ('' without a result)."""
    if res is None:
        return ""
    fam = family_of(res)
    name = FAMILY_NAMES.get(fam, fam)
    if fam != "eagle3":
        return f"{name} block {res.comparability.block_size}"
    rec = res.drafter.eagle3 or {}
    tree = rec.get("tree")
    if rec.get("decoding") == "tree" and isinstance(tree, dict):
        return f"{name} tree {tree.get('total_token')},{tree.get('depth')},{tree.get('top_k')}"
    return f"{name} chain {rec.get('chain_length') or res.comparability.block_size - 1}"


def families(runs) -> set[str]:
    """The families of the runs with results (Result-s of orchestrator.results.compare)."""
    return {family_of(r.result) for r in runs if r.result is not None}
