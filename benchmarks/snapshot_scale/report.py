"""The summary of `benchmarks/snapshot_scale/run.py`: per size, Baton's time over each baseline's
in the same round (median and range) and the rates; a projection to 7B and 70B models on 16
and 128 workers from the rates of the largest size measured; the Markdown tables.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.common import ratios

# The projection's cluster: workers per node, and the models: parameters and parameter
# tensors (Llama-2 7B: 32 layers of 9 tensors + 3; 70B: 80 layers + 3).
WORKERS_PER_NODE = 8
MODELS = {"7B": (7e9, 32 * 9 + 3), "70B": (70e9, 80 * 9 + 3)}
# A crc32 costs about this much metadata: ~12 bytes of JSON in a receipt, ~20 in the
# indented manifest.
META_PER_BLOCK = 32
BYTES_PER_PARAM = 16  # AdamW with fp32 state, as the issue counts it (7B -> 112 GB)


def summarise(got: dict[str, Any], rss: dict[str, Any],
              s3: dict[str, list[float]] | None) -> dict[str, Any]:
    """One size's entry of the results file: the times, the ratios and the rates (GB/s)."""
    t = got["times"]
    gb = got["state_bytes"] / 1e9
    med = {k: statistics.median(v) for k, v in t.items()}
    out: dict[str, Any] = {
        "state_gb": gb, "times_s": t, "rss": rss,
        "coordinator_bytes": got["coordinator_bytes"],
        "capture_vs_save": ratios(t["capture"], t["save"]),
        "capture_vs_dcp_return": ratios(t["capture"], t["dcp_return"]),
        "persist_vs_save": ratios(t["persist"], t["save"]),
        "persist_vs_dcp_done": ratios(t["persist"], t["dcp_done"]),
        "restore_disk_vs_load": ratios(t["restore_disk"], t["load"]),
        "restore_ram_vs_load": ratios(t["restore_ram"], t["load"]),
        "fresh_restore_vs_load": ratios(rss["fresh_restore_s"]["baton"],
                                        rss["fresh_restore_s"]["torch"]),
        "gb_per_s": {k: gb / v for k, v in med.items()},
    }
    if s3:
        out["s3_times_s"] = s3
        out["s3_persist_vs_save"] = ratios(s3["s3_persist"], s3["s3_save"])
        out["s3_restore_vs_load"] = ratios(s3["s3_restore"], s3["s3_load"])
        out["gb_per_s"].update({k: gb / statistics.median(v) for k, v in s3.items()})
    return out


def project(results: dict[str, Any]) -> dict[str, Any]:
    """7B / 70B on 16 / 128 workers from the per-process rates of the largest size measured
    (one process's rate taken as a node's: conservative for a node's disk and copies)."""
    base = max(results.values(), key=lambda r: r["state_gb"])
    rate = base["gb_per_s"]
    meta = base["coordinator_bytes"]
    # The coordinator's metadata (receipts + manifest) is O(chunks + checksum blocks): the
    # measured bytes less the blocks' share, per chunk.
    per_chunk = (meta["receipts_per_snapshot"] + meta["manifest"]
                 - META_PER_BLOCK * meta["blocks"]) / meta["chunks"]
    storage_rate = rate.get("s3_restore", rate["restore_disk"])
    rows = {}
    for name, (params, param_tensors) in MODELS.items():
        state = params * BYTES_PER_PARAM / 1e9  # GB
        for workers in (16, 128):
            nodes = workers // WORKERS_PER_NODE
            per_node = state / nodes
            after = max(nodes - 1, 1)
            lost = 1 / nodes  # the RAM-tier copies the lost node held come from storage
            # FSDP2: weights and both moments in one chunk per worker; step counters whole.
            chunks = 3 * param_tensors * workers + param_tensors
            blocks = chunks + state * 1e9 / meta["block_bytes"]
            head = per_chunk * chunks + META_PER_BLOCK * blocks
            rows[f"{name}/{workers}"] = {
                "state_gb": state, "nodes": nodes, "chunks": chunks,
                "head_mb_per_snapshot": head / 1e6,
                "head_ram_mb": 2 * head / 1e6,  # the committed manifest + one in flight
                "stall_s": state / workers / rate["capture"],
                "snapshot_s": per_node / rate["persist"],
                "ram_tier_gb_per_node": 2 * per_node,  # committed + in flight
                "restore_after_node_loss_s": state / after * (
                    (1 - lost) / rate["restore_ram"] + lost / storage_rate),
                "restore_all_from_storage_s": state / after / storage_rate,
            }
    return {"from_state_gb": base["state_gb"], "workers_per_node": WORKERS_PER_NODE,
            "bytes_per_param": BYTES_PER_PARAM, "metadata_bytes_per_chunk": per_chunk,
            "metadata_bytes_per_block": META_PER_BLOCK,
            "storage_rate": "s3 (moto)" if "s3_restore" in rate else "local disk",
            "rows": rows}



def print_tables(results: dict[str, Any]) -> None:
    """The ratios per size and the projection, as Markdown tables."""
    def cell(r: dict[str, float] | None) -> str:
        return "-" if r is None else f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"

    sizes = [s for s in results if s != "projection"]
    print("| | " + " | ".join(f"{results[s]['state_gb']:.2f} GB" for s in sizes) + " |")
    print("|---" * (len(sizes) + 1) + "|")
    for label, key in (
            ("blocking capture / torch.save+fsync", "capture_vs_save"),
            ("blocking capture / dcp.async_save returns", "capture_vs_dcp_return"),
            ("background persist / torch.save+fsync", "persist_vs_save"),
            ("background persist / dcp.async_save done", "persist_vs_dcp_done"),
            ("restore, local disk / torch.load+load_state_dict", "restore_disk_vs_load"),
            ("restore, RAM tier / torch.load+load_state_dict", "restore_ram_vs_load"),
            ("restore in a fresh process, local disk / the same with torch.load",
             "fresh_restore_vs_load"),
            ("S3 persist / torch.save+boto3 upload", "s3_persist_vs_save"),
            ("S3 restore / boto3 download+torch.load", "s3_restore_vs_load")):
        print(f"| {label} | " + " | ".join(cell(results[s].get(key)) for s in sizes) + " |")
    print("| GB/s: persist, torch.save, dcp done | " + " | ".join(
        "{persist:.2f}, {save:.2f}, {dcp_done:.2f}".format(**results[s]["gb_per_s"])
        for s in sizes) + " |")
    print("| GB/s: restore disk, RAM, torch.load | " + " | ".join(
        "{restore_disk:.2f}, {restore_ram:.2f}, {load:.2f}".format(**results[s]["gb_per_s"])
        for s in sizes) + " |")
    for mode in ("baton", "torch"):
        print(f"| restore RSS growth, peak / state ({mode}) | " + " | ".join(
            f"{results[s]['rss'][mode]['growth']:.2f}x, {results[s]['rss'][mode]['peak']:.2f}x"
            for s in sizes) + " |")
    print("| coordinator bytes per snapshot (receipts + manifest) | " + " | ".join(
        "{:.0f} KB".format((results[s]["coordinator_bytes"]["receipts_per_snapshot"]
                            + results[s]["coordinator_bytes"]["manifest"]) / 1e3)
        for s in sizes) + " |")
    proj = results["projection"]
    print(f"\nProjection from the {proj['from_state_gb']:.2f} GB rates "
          f"({proj['workers_per_node']} workers per node, storage: {proj['storage_rate']}):")
    print("| model / workers | state | head bytes per snapshot | head RAM | stall | "
          "snapshot (per node) | RAM tier per node | restore after a node loss | "
          "all from storage |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in proj["rows"].items():
        print(f"| {name} | {r['state_gb']:.0f} GB | {r['head_mb_per_snapshot']:.1f} MB | "
              f"{r['head_ram_mb']:.1f} MB | {r['stall_s']:.2f} s | {r['snapshot_s']:.0f} s | "
              f"{r['ram_tier_gb_per_node']:.0f} GB | {r['restore_after_node_loss_s']:.0f} s | "
              f"{r['restore_all_from_storage_s']:.0f} s |")

