#!/usr/bin/env python3
"""loom.moe_layer at W = 1 beside its compute-only bound, the composed loom calls and torch, in one
process on one GPU (issue 22).

    python3 bench/moe_layer.py --json moe_layer.json
    python3 bench/moe_layer.py --tokens 4096 --models deepseek-v3 --tile 128x256

The per-GPU slices of expert-parallel MoE layers, as bench/grouped_gemm.py: DeepSeek-V3 (H 7168,
I 2048, 32 experts per GPU, top-8) and Qwen3-235B (H 4096, I 1536, 16 per GPU, top-8); 1K, 4K
and 16K tokens per GPU by default (--tokens). At W = 1 every expert is local: all
T k routed rows land on this GPU (capacity T k, none dropped). Routing: uniform (each token's k
distinct experts drawn uniformly) or skewed (k distinct draws, one after another, from one
Categorical(p) over the experts, p ~ U(0, 1) drawn once: tools/loom-bench/moe_bench.cu's
make_topk_ids); router weights U(0, 1). Token rows N(0, 1); weights N(0, 1) / sqrt(K), bf16.

Columns (ms; the median of --iters rounds after --warmup, each round timing every column once with
CUDA events in a fresh random order: bench_common.time_shuffled):
  loom           loom.moe_layer on one routing (loom.moe_routing once, outside the timing)
  compute_bound  the layer's two GEMMs alone on the rows already dispatched into recv_x:
                 loom.grouped_gemm fc1 (activation 'swiglu', recv_x -> hidden), then fc2
                 (hidden -> expert_out); no dispatch, no combine
  loom_composed  loom.moe_dispatch_gemm ('swiglu') -> loom.grouped_gemm fc2 -> loom.moe_combine
  torch          x.index_select into expert order (the all_to_all is the identity at one rank),
                 torch._grouped_mm fc1, silu(gate) * up, torch._grouped_mm fc2, times the router
                 weights, out.zero_() and index_add_ (bf16 throughout, torch's cheapest form); the
                 sort by expert (the counterpart of loom's routing) is outside the timing
--shared-expert adds the model's shared expert (DeepSeek-V3: one, of width I; models without one
are skipped) to every column: loom passes it to moe_layer (its tiles run first in the kernel);
compute_bound adds its two GEMMs (loom.grouped_gemm, one group over the T tokens); loom_composed
adds the same two calls and a torch add into out; torch adds torch.mm, silu * up, torch.mm and
an add. composed_bits_equal is then null (moe_layer adds the shared row before its one rounding).
--tile (default 'auto': each call's own planner) goes to every loom call. rel_err = ||out_loom -
out_torch|| / ||out_torch||; composed_bits_equal: loom's out equals loom_composed's bit for bit
(loom guarantees it on one tile, so with an explicit --tile; under 'auto' the planners may pick
different tiles). Exit 1 when a rel_err exceeds --max-rel-err.

torch._grouped_mm (torch 2.11): bf16 only; A [rows, K] row-major, B [E, K, N] (the [E, N, K]
weights' transposed views, as bench/grouped_gemm.py), offs int32 [E] cumulative group ends; any
group size is taken, 0 included.

Rows: {"op": "moe_layer", "model", "tokens", "routing", "E" (experts on the GPU), "top_k", "H",
"I", "rows" (T k), "max_over_mean" (the busiest expert's rows over the mean), "tile", "ms":
{"loom", "compute_bound", "loom_composed", "torch"; with --padded also "loom_padded" and
"bound_padded": both with swap_tails=False, each expert's last tile row padded; with --plain-groups
"loom_plain_groups": moe_layer with expert_groups=False}, "rel_err",
"composed_bits_equal", "shared_expert", "phases" (with --phases: summarize_phases of one more launch)}; the
document adds "world" (1), "git_sha", "date", "gpu", "host", "torch", "loom", "command". The
table is printed last, with the ratios compute_bound/loom, loom_composed/loom and torch/loom
(above 1: loom's one kernel is faster). Refused in the shared-GPU mode (LOOM_RANKS_PER_GPU > 1)
and under a launcher of several ranks.
"""

import argparse
import datetime
import json
import os
import random
import socket
import sys

from bench_common import add_queue_option, git_sha, time_both

MODELS = {  # name: (H, I, experts per GPU, top-k)
    "deepseek-v3": (7168, 2048, 32, 8),
    "qwen3-235b": (4096, 1536, 16, 8),
}
SHARED_EXPERTS = {"deepseek-v3": 1, "qwen3-235b": 0}  # shared experts of width I
TILES = ("auto", "128x256", "128x128")
COLUMNS = ("loom", "compute_bound", "loom_composed", "torch")
PADDED_COLUMNS = ("loom_padded", "bound_padded")  # --padded
PLAIN_GROUP_COLUMNS = ("loom_plain_groups",)  # --plain-groups


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--tokens", default="1024,4096,16384", help="tokens per GPU, comma-separated")
    p.add_argument("--routing", default="uniform,skewed")
    p.add_argument("--tile", default="auto", choices=TILES, help="every loom call's tile (auto: each call's planner)")
    p.add_argument("--push-ctas", type=int, default=0, help="moe_layer's and moe_dispatch_gemm's push CTAs (0: planner)")
    p.add_argument("--arrival-ctas", type=int, default=0, help="their arrival CTAs (0: planner)")
    p.add_argument("--shared-expert", action="store_true",
                   help="add the model's shared expert to every column (models without one are skipped)")
    p.add_argument("--phases", action="store_true",
                   help="after the timing, one more moe_layer launch records where each CTA's time went "
                        "(MoeLayerPhaseRecord); each row gains 'phases' and a second table follows")
    p.add_argument("--padded", action="store_true",
                   help="also time moe_layer and the compute bound with swap_tails=False (each expert's last tile "
                        "row padded to the tile) in the same rounds: ms.loom_padded, ms.bound_padded")
    p.add_argument("--plain-groups", action="store_true",
                   help="also time moe_layer with expert_groups=False (raster groups of group_m tile rows whatever "
                        "the experts) in the same rounds: ms.loom_plain_groups")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20, help="timed rounds per shape (median; at least 20)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--max-rel-err", type=float, default=2e-2)
    add_queue_option(p)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.iters < 20:
        p.error("--iters must be at least 20 (medians of fewer are noise)")
    args.models = [m for m in args.models.split(",") if m]
    for m in args.models:
        if m not in MODELS:
            p.error(f"unknown model {m!r}: expected one of {', '.join(MODELS)}")
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    if not args.tokens or min(args.tokens) < 1:
        p.error("--tokens must list positive token counts")
    if args.shared_expert:
        args.models = [m for m in args.models if SHARED_EXPERTS[m] > 0]
        if not args.models:
            p.error("--shared-expert: none of --models has a shared expert")
    args.routing = [r for r in args.routing.split(",") if r]
    for r in args.routing:
        if r not in ("uniform", "skewed"):
            p.error(f"unknown routing {r!r}: expected uniform or skewed")
    return args


def refusal():
    """Why this process must not time anything (None: it may)."""
    counts = {}
    for name in ("LOOM_RANKS_PER_GPU", "WORLD_SIZE"):
        text = os.environ.get(name, "").strip() or "1"
        try:
            counts[name] = int(text)
        except ValueError:
            return f"{name}={text!r} is not an integer"
    if counts["LOOM_RANKS_PER_GPU"] > 1:
        # Ranks sharing a GPU take turns on it: nothing timed there means anything (as loom-bench).
        return (f"LOOM_RANKS_PER_GPU={counts['LOOM_RANKS_PER_GPU']} is the shared-GPU mode, a correctness mode: ranks "
                "take turns on one GPU, so this benchmark times nothing there (unset it)")
    if counts["WORLD_SIZE"] != 1:
        return f"WORLD_SIZE={counts['WORLD_SIZE']}: this is the W = 1 benchmark; run it as one process on one GPU"
    return None


def make_topk_ids(routing, tokens, experts, k, seed):
    """int32 [tokens, k] on the CPU: each token's k distinct experts (see the module's doc)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if routing == "skewed":
        p = torch.rand(experts, generator=torch.Generator().manual_seed(seed * 7919))
        ids = torch.multinomial(p.expand(tokens, experts), k, replacement=False, generator=g)
    else:
        ids = torch.rand(tokens, experts, generator=g).topk(k, dim=1).indices
    return ids.to(torch.int32)


def expert_order(ids, experts):
    """What the torch path precomputes from the routing: the slots sorted by (expert, token, slot)
    (the receive order at W = 1), each sorted row's token, and the int32 cumulative group ends
    torch._grouped_mm takes as offs."""
    import torch

    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    ends = torch.bincount(flat, minlength=experts).cumsum(0).to(torch.int32)
    return order, order // ids.shape[1], ends


def start_world_of_one(heap_bytes):
    """A loom communicator of one rank (as bench/ring_attention.py without a launcher: GPU 0)."""
    import torch
    import torch.distributed as dist

    import loom

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(29500 + os.getpid() % 1000))
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("gloo")
    return loom.Communicator.from_process_group(heap_bytes=heap_bytes)


def heap_bytes_for(args):
    """The symmetric heap the largest case needs: recv_x and expert_out [T k, H] bf16, plus room
    for loom's MoE workspace (small within one node) and the allocator."""
    largest = max(2 * t * MODELS[m][3] * MODELS[m][0] * 2 for m in args.models for t in args.tokens)
    mib64 = 64 << 20
    return (largest + (1 << 30) + mib64 - 1) // mib64 * mib64


def run_case(torch, loom, lt, comm, args, model, weights, tokens, routing):
    """One (model, tokens, routing) row: the four columns timed on one routing, and the checks."""
    import torch.nn.functional as F

    hidden, inter, experts, top_k = MODELS[model]
    gate_up, down, w1_t, w2_t, shared = weights
    shared_gate_up, shared_down, shared_w1_t, shared_w2_t = shared if shared else (None,) * 4
    dev = torch.device("cuda", comm.device)
    bf16 = torch.bfloat16
    seed = args.seed * 1000 + tokens + (1 if routing == "skewed" else 0)
    ids = make_topk_ids(routing, tokens, experts, top_k, seed)
    router = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(seed + 1))
    x = torch.randn(tokens, hidden, device=dev, dtype=bf16)
    config = loom.MoeConfig(num_experts=experts, top_k=top_k, hidden=hidden, dtype=bf16, max_tokens=tokens)
    bufs = lt.moe_buffers(comm, config, hidden_intermediate=inter, shared_expert=bool(shared))
    capacity = bufs.sizes.capacity
    words = -(-loom.grouped_gemm_workspace_bytes(capacity, experts) // 4)
    workspace = torch.empty(max(words, 1), device=dev, dtype=torch.int32)
    out_loom = torch.full((tokens, hidden), float("nan"), device=dev, dtype=bf16)
    out_composed = torch.full_like(out_loom, float("nan"))
    out_torch = torch.empty_like(out_loom)
    plan = loom.moe_routing(comm, config, ids.to(dev), topk_weights=router.to(dev), plan_buffer=bufs.plan_buffer,
                            expert_offsets=bufs.expert_offsets)
    report = loom.moe_report(comm, plan)  # waits; raises what the routing found
    if report.kept_rows != tokens * top_k:
        raise SystemExit(f"moe_layer bench: {report.kept_rows} of {tokens * top_k} rows kept ({report})")
    order, token_of_row, ends = expert_order(ids, experts)
    token_of_row, offs = token_of_row.to(dev), ends.to(dev)
    w_rows = router.reshape(-1)[order].to(dev, bf16).unsqueeze(1)  # each sorted row's router weight
    counts = torch.diff(ends, prepend=torch.zeros(1, dtype=torch.int32))
    tile = args.tile
    # The shared expert through loom.grouped_gemm: one group of the T tokens (compute_bound and
    # loom_composed), into buffers of its own.
    routed_rows = capacity  # hidden and expert_out rows of the routed experts (the shared ones follow)
    if shared:
        shared_offsets = torch.tensor([0, tokens], device=dev, dtype=torch.int32)
        shared_hidden = torch.empty(tokens, inter, device=dev, dtype=bf16)
        shared_y = torch.empty(tokens, hidden, device=dev, dtype=bf16)
        shared_words = -(-loom.grouped_gemm_workspace_bytes(tokens, 1) // 4)
        shared_workspace = torch.empty(max(shared_words, 1), device=dev, dtype=torch.int32)

    def run_shared_expert():
        loom.grouped_gemm(x, shared_gate_up.unsqueeze(0), shared_hidden, workspace=shared_workspace,
                          offsets=shared_offsets, tile=tile, activation="swiglu")
        loom.grouped_gemm(shared_hidden, shared_down.unsqueeze(0), shared_y, workspace=shared_workspace,
                          offsets=shared_offsets, tile=tile)

    def run_loom(swap_tails=True, expert_groups=True):
        loom.moe_layer(comm, plan, x, gate_up, down, bufs.recv_x, bufs.hidden, bufs.expert_out, out_loom, tile=tile,
                       push_ctas=args.push_ctas, arrival_ctas=args.arrival_ctas, shared_gate_up=shared_gate_up,
                       shared_down=shared_down, swap_tails=swap_tails, expert_groups=expert_groups)

    def run_compute_bound(swap_tails=True):
        loom.grouped_gemm(bufs.recv_x, gate_up, bufs.hidden[:routed_rows], workspace=workspace,
                          offsets=bufs.expert_offsets, tile=tile, activation="swiglu", swap_tails=swap_tails)
        loom.grouped_gemm(bufs.hidden[:routed_rows], down, bufs.expert_out[:routed_rows], workspace=workspace,
                          offsets=bufs.expert_offsets, tile=tile, swap_tails=swap_tails)
        if shared:
            run_shared_expert()

    def run_composed():
        loom.moe_dispatch_gemm(comm, plan, x, bufs.recv_x, gate_up, bufs.hidden[:routed_rows], activation="swiglu",
                               tile=tile, push_ctas=args.push_ctas, arrival_ctas=args.arrival_ctas)
        loom.grouped_gemm(bufs.hidden[:routed_rows], down, bufs.expert_out[:routed_rows], workspace=workspace,
                          offsets=bufs.expert_offsets, tile=tile)
        loom.moe_combine(comm, plan, bufs.expert_out[:routed_rows], out_composed)
        if shared:
            run_shared_expert()
            out_composed.add_(shared_y)

    def run_torch():
        rows = x.index_select(0, token_of_row)
        h1 = torch._grouped_mm(rows, w1_t, offs=offs)  # [T k, 2I]: gate | up
        gate, up = h1.chunk(2, dim=1)
        y = torch._grouped_mm(F.silu(gate) * up, w2_t, offs=offs)  # [T k, H]
        y.mul_(w_rows)
        out_torch.zero_()
        out_torch.index_add_(0, token_of_row, y)
        if shared:
            sg, su = torch.mm(x, shared_w1_t).chunk(2, dim=1)
            out_torch.add_(torch.mm(F.silu(sg) * su, shared_w2_t))

    run_loom()  # recv_x now holds the dispatched rows compute_bound reads
    run_composed()
    run_torch()
    comm.synchronize()
    rel_err = float((out_loom.float() - out_torch.float()).norm() / out_torch.float().norm())
    bits_equal = None if shared else bool(torch.equal(out_loom.view(torch.int16), out_composed.view(torch.int16)))
    candidates = {"loom": run_loom, "compute_bound": run_compute_bound, "loom_composed": run_composed,
                  "torch": run_torch}
    if args.padded:
        candidates.update(loom_padded=lambda: run_loom(False), bound_padded=lambda: run_compute_bound(False))
    if args.plain_groups:
        candidates.update(loom_plain_groups=lambda: run_loom(expert_groups=False))
    timing = time_both(candidates, args.warmup, args.iters, args.queue_behind_us)
    ms = timing["ms"]
    comm.synchronize()  # raises a device-side failure of the timed loom calls
    phases = None
    if args.phases:
        records = torch.zeros(64 * comm.sm_count, device=dev, dtype=torch.uint8)
        loom.moe_layer(comm, plan, x, gate_up, down, bufs.recv_x, bufs.hidden, bufs.expert_out, out_loom, tile=tile,
                       push_ctas=args.push_ctas, arrival_ctas=args.arrival_ctas, shared_gate_up=shared_gate_up,
                       shared_down=shared_down, phases=records)
        comm.synchronize()
        phases = summarize_phases(loom.moe_layer_phases(records))
    return {"op": "moe_layer", "model": model, "tokens": tokens, "routing": routing, "E": experts, "top_k": top_k,
            "H": hidden, "I": inter, "rows": tokens * top_k,
            "max_over_mean": float(counts.max()) / (tokens * top_k / experts), "tile": tile,
            "push_ctas": args.push_ctas, "arrival_ctas": args.arrival_ctas,
            "ms": {name: ms[name] for name in COLUMNS + (PADDED_COLUMNS if args.padded else ())
                   + (PLAIN_GROUP_COLUMNS if args.plain_groups else ())},
            "rel_err": rel_err, "composed_bits_equal": bits_equal,
            "shared_expert": bool(shared), **{k: v for k, v in timing.items() if k != "ms"},
            **({"phases": phases} if phases else {})}


def summarize_phases(records):
    """One launch's phase records (loom.moe_layer_phases) as milliseconds from its first CTA's entry:
    when the dispatch roles were done (the last of them), when the CTAs' first tiles were claimed
    (median, last), when their queues ran dry (first, last) and their combine shares ended (last),
    and the combine's tail (the last share's end minus the last queue's end, "combine_tail");
    and per CTA, on average, how long its claims waited for inputs (fc1 for receive blocks, fc2 for
    fc1 rows). The CTAs that only compute (no dispatch role first) are also summarized on their
    own ("compute_*": their first tile's median, their waits per CTA), and "per_cta" keeps every
    CTA's record with its times in ms from the same origin."""
    t0 = min(r["entered_ns"] for r in records)

    def ms(ns):
        return (ns - t0) / 1e6

    def median_ms(values):  # the upper median of nanosecond times, in ms; 0 for none
        values = sorted(values)
        return ms(values[len(values) // 2]) if values else 0.0

    dispatch = [r["roles_done_ns"] for r in records if r["role"] != "compute"]
    first = sorted(r["first_tile_ns"] for r in records if r["tiles"] > 0)
    done = [r["tiles_done_ns"] for r in records]
    reduced = [r["reduced_ns"] for r in records if r["reduced_ns"] > 0]
    compute = [r for r in records if r["role"] == "compute"]
    n = len(records)
    times = ("roles_done_ns", "first_tile_ns", "tiles_done_ns", "reduced_ns")
    per_cta = [{"cta": r["cta"], "role": r["role"], "tiles": r["tiles"],
                **{k[:-3]: (ms(r[k]) if r[k] else None) for k in times},
                "up_wait": r["up_wait_ns"] / 1e6, "down_wait": r["down_wait_ns"] / 1e6} for r in records]
    return {"ctas": n, "dispatch_done": ms(max(dispatch)) if dispatch else 0.0,
            "first_tile_median": median_ms(first),
            "first_tile_last": ms(first[-1]) if first else 0.0,
            "queue_dry_first": ms(min(done)), "queue_dry_last": ms(max(done)),
            "combine_done": ms(max(reduced)) if reduced else 0.0,
            "combine_tail": (max(reduced) - max(done)) / 1e6 if reduced else 0.0,
            "up_wait_per_cta": sum(r["up_wait_ns"] for r in records) / n / 1e6,
            "down_wait_per_cta": sum(r["down_wait_ns"] for r in records) / n / 1e6,
            "tiles": sum(r["tiles"] for r in records),
            "compute_ctas": len(compute),
            "compute_first_tile_median": median_ms(r["first_tile_ns"] for r in compute if r["tiles"] > 0),
            "compute_up_wait_per_cta": sum(r["up_wait_ns"] for r in compute) / len(compute) / 1e6 if compute else 0.0,
            "compute_down_wait_per_cta": sum(r["down_wait_ns"] for r in compute) / len(compute) / 1e6 if compute else 0.0,
            "per_cta": per_cta}


PHASE_COLUMNS = ("dispatch_done", "first_tile_median", "first_tile_last", "queue_dry_first", "queue_dry_last",
                 "combine_done", "up_wait_per_cta", "down_wait_per_cta", "compute_first_tile_median",
                 "compute_up_wait_per_cta")


def print_phases(rows):
    print("\nwhere moe_layer's time went (one launch; ms from its first CTA's entry; waits: per CTA, summed "
          "over its claims)")
    width = {c: max(19, len(c) + 2) for c in PHASE_COLUMNS}
    print(f"{'model':<13}{'tokens':>7} {'routing':<9}" + "".join(f"{c:>{width[c]}}" for c in PHASE_COLUMNS))
    for r in rows:
        ph = r["phases"]
        print(f"{r['model']:<13}{r['tokens']:>7} {r['routing']:<9}" +
              "".join(f"{ph[c]:>{width[c]}.3f}" for c in PHASE_COLUMNS))


def model_weights(torch, lt, model, dev, shared_expert=False):
    """This GPU's experts: loom's gate_up [E, 2I, H] (interleaved by 8) and down [E, H, I], and
    torch's [E, H, 2I] (gate | up) and [E, I, H] views of the same values; with shared_expert also
    the shared expert's (loom's [2I, H] and [H, I], torch's [H, 2I] and [I, H]), else None."""
    hidden, inter, experts, _ = MODELS[model]
    bf16 = torch.bfloat16
    gate = torch.randn(experts, inter, hidden, device=dev, dtype=bf16) / hidden ** 0.5
    up = torch.randn(experts, inter, hidden, device=dev, dtype=bf16) / hidden ** 0.5
    down = torch.randn(experts, hidden, inter, device=dev, dtype=bf16) / inter ** 0.5
    gate_up = lt.swiglu_weights(gate, up).contiguous()
    w1 = torch.cat([gate, up], dim=1)  # torch's fc1: gate rows, then up rows
    shared = None
    if shared_expert:
        s_gate = torch.randn(1, inter, hidden, device=dev, dtype=bf16) / hidden ** 0.5
        s_up = torch.randn(1, inter, hidden, device=dev, dtype=bf16) / hidden ** 0.5
        s_down = torch.randn(hidden, inter, device=dev, dtype=bf16) / inter ** 0.5
        s_w1 = torch.cat([s_gate[0], s_up[0]], dim=0)  # [2I, H]: gate rows, then up rows
        shared = (lt.swiglu_weights(s_gate, s_up)[0].contiguous(), s_down, s_w1.t(), s_down.t())
    return gate_up, down, w1.transpose(-2, -1), down.transpose(-2, -1), shared


def print_table(rows):
    shared = " with the shared expert" if rows and rows[0].get("shared_expert") else ""
    print(f"\nms (one GPU, W = 1, bf16{shared}); ratios: column / loom (above 1: moe_layer is faster)")
    print(f"{'model':<13}{'tokens':>7} {'routing':<9}{'max/mean':>9}" + "".join(f"{c:>15}" for c in COLUMNS)
          + f"{'bound/loom':>12}{'composed/loom':>15}{'torch/loom':>12}{'rel_err':>10}{'same_bits':>10}")
    for r in rows:
        ms = r["ms"]
        print(f"{r['model']:<13}{r['tokens']:>7} {r['routing']:<9}{r['max_over_mean']:>9.2f}"
              + "".join(f"{ms[c]:>15.3f}" for c in COLUMNS)
              + f"{ms['compute_bound'] / ms['loom']:>12.3f}{ms['loom_composed'] / ms['loom']:>15.3f}"
              f"{ms['torch'] / ms['loom']:>12.3f}{r['rel_err']:>10.2e}{same_bits_text(r['composed_bits_equal']):>10}")

    def sub_table(title, key, columns, ratios):  # ratios: (header, width, fn(ms)) each
        chosen = [r for r in rows if key in r and all(c in r[key] for c in columns)]
        if not chosen:
            return
        print(f"\n{title}")
        print(f"{'model':<13}{'tokens':>7} {'routing':<9}" + "".join(f"{c:>15}" for c in columns)
              + "".join(f"{h:>{w}}" for h, w, _ in ratios))
        for r in chosen:
            ms = r[key]
            print(f"{r['model']:<13}{r['tokens']:>7} {r['routing']:<9}" + "".join(f"{ms[c]:>15.3f}" for c in columns)
                  + "".join(f"{fn(ms):>{w}.3f}" for _, w, fn in ratios))

    sub_table("the same, each call queued behind a spin kernel (ms_queued: the GPU's time without the host's share)",
              "ms_queued", COLUMNS,
              [("bound/loom", 12, lambda ms: ms["compute_bound"] / ms["loom"]),
               ("composed/loom", 15, lambda ms: ms["loom_composed"] / ms["loom"]),
               ("torch/loom", 12, lambda ms: ms["torch"] / ms["loom"])])
    sub_table("swap_tails=False (each expert's last tile row padded); ratios: padded / swapped time", "ms",
              PADDED_COLUMNS,
              [("layer", 8, lambda ms: ms["loom_padded"] / ms["loom"]),
               ("bound", 8, lambda ms: ms["bound_padded"] / ms["compute_bound"])])
    sub_table("expert_groups=False (plain raster groups); ratio: plain / expert groups' time", "ms",
              ("loom", "loom_plain_groups"), [("plain/expert", 14, lambda ms: ms["loom_plain_groups"] / ms["loom"])])


def same_bits_text(equal):
    return "n/a" if equal is None else ("yes" if equal else "no")


def main():
    args = parse_args()
    why = refusal()
    if why:
        print(f"moe_layer bench: {why}", file=sys.stderr)
        sys.exit(2)
    import torch
    import torch.distributed as dist

    import loom
    import loom.torch as lt

    comm = start_world_of_one(heap_bytes_for(args))
    dev = torch.device("cuda", comm.device)
    torch.manual_seed(args.seed)
    random.seed(0)  # the shuffled rounds' order
    rows = []
    for model in args.models:
        weights = model_weights(torch, lt, model, dev, args.shared_expert)
        for tokens in sorted(args.tokens):
            for routing in args.routing:
                row = run_case(torch, loom, lt, comm, args, model, weights, tokens, routing)
                rows.append(row)
                ms = row["ms"]
                print(f"[{len(rows)}] {model} T{tokens} {routing}: " + ", ".join(f"{c} {ms[c]:.3f}" for c in COLUMNS)
                      + f" ms, rel_err {row['rel_err']:.2e}, composed bits equal: {row['composed_bits_equal']}",
                      flush=True)
                torch.cuda.empty_cache()
        del weights
        torch.cuda.empty_cache()

    result = {"git_sha": git_sha(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name(), "host": socket.gethostname(), "world": 1, "nodes": 1,
              "torch": torch.__version__, "loom": loom.__version__, "command": " ".join(sys.argv), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.phases:
        print_phases(rows)
    print_table(rows)
    comm.close()  # every symmetric buffer went with its case
    dist.destroy_process_group()
    sys.exit(1 if any(not (r["rel_err"] <= args.max_rel_err) for r in rows) else 0)


if __name__ == "__main__":
    main()
