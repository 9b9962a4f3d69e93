#!/usr/bin/env python3
"""loom.ring_attention beside the attention engine alone and cuDNN, per GPU (one process per rank).

    python3 bench/ring_attention.py --json ring.json                 # W = 1 (one GPU)
    torchrun --nproc-per-node 2 bench/ring_attention.py --json ring.json

Default shapes (hd128, bf16): B 1, S_l 8K and 32K, H 32 (MHA) and 64 / 8 (GQA), causal (zigzag)
and non-causal. Columns (ms, median of --iters shuffled rounds after warm-up, maximum over ranks):
  loom             loom.ring_attention on this rank's chunk
  attention        the engine alone on the same per-GPU work (this rank's queries over all W * S_l
                   keys, on one GPU): the ring's overhead at W = 1, its ceiling at W > 1
  cudnn            torch SDPA's cuDNN backend on the same per-GPU work (the single-GPU ceiling)
  allgather_cudnn  (W > 1) NCCL all_gather of K and V, then cuDNN SDPA (causal: each zigzag half
                   with a bottom-right causal mask)
  torch_ring       a ring in torch as ring-flash-attn runs it: per step, NCCL isend/irecv of the next
                   K/V chunk (only the KV heads travel) beside cuDNN SDPA on the current one (its LSE
                   returned; GQA heads expanded after arrival), outputs merged in fp32 by LSE; zigzag
                   causal as one unmasked half-size call per remote step. Its own rel_err is checked
Every loom output is checked against torch's fp32 math on a sample of rows (rel_err). TFLOP/s per
GPU = 4 B H S_l (W S_l) D / time, halved under causal masks. NVLink multicast stays off.
"""

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse
import datetime
import json
import math
import random
import socket
import sys

from bench_common import git_sha, time_shuffled


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1x8192x32x32x128,1x32768x32x32x128,1x8192x64x8x128,1x32768x64x8x128",
                   help="comma-separated BxS_lxHxHkvxD (S_l: rows per rank)")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default="")
    args = p.parse_args()
    if args.iters < 20:
        p.error("--iters must be at least 20")
    args.shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
    args.causal = [bool(int(c)) for c in args.causal.split(",") if c != ""]
    return args


def main():
    args = parse_args()
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    import loom
    import loom.torch as lt

    if "RANK" not in os.environ:  # one GPU, no launcher: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(29500 + os.getpid() % 1000))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl" if int(os.environ["WORLD_SIZE"]) > 1 else "gloo")
    comm = loom.Communicator.from_process_group()
    world, rank = comm.local_world_size, comm.rank
    dev = torch.device("cuda", local)
    random.seed(0)
    rows = []

    def sdpa_cudnn(q, k, v, causal_lr):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            mask = causal_lower_right(q.shape[2], k.shape[2]) if causal_lr else None
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

    for (B, S, H, Hkv, D) in args.shapes:
        for causal in args.causal:
            g = torch.Generator(device=dev).manual_seed(1234)  # the same whole sequence on every rank
            total = world * S
            qf = torch.randn(B, total, H, D, device=dev, dtype=torch.bfloat16, generator=g)
            kf = torch.randn(B, total, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
            vf = torch.randn(B, total, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
            if causal:
                q, k, v = (lt.zigzag_shard(x, world, rank).contiguous() for x in (qf, kf, vf))
            else:
                q, k, v = (x[:, rank * S:(rank + 1) * S].contiguous() for x in (qf, kf, vf))
            out = torch.full_like(q, float("nan"))
            lse = torch.empty(B, H, S, device=dev, dtype=torch.float32)
            loom.ring_attention(comm, q, k, v, out, lse=lse, causal=causal)
            comm.synchronize()
            # Reference: fp32 over the whole sequence, this rank's rows (a sample).
            pos = torch.arange(S, device=dev) + rank * S
            if causal:
                half = S // 2
                pos = torch.cat([torch.arange(half, device=dev) + rank * half,
                                 torch.arange(half, device=dev) + (2 * world - 1 - rank) * half])
            sample = torch.randperm(S, device=dev)[:64].sort().values
            qs = q[:, sample].float().transpose(1, 2)
            kr = kf.float().transpose(1, 2).repeat_interleave(H // Hkv, 1)
            vr = vf.float().transpose(1, 2).repeat_interleave(H // Hkv, 1)
            num = den = 0.0
            for h0 in range(0, H, 8):
                s = qs[:, h0:h0 + 8] @ kr[:, h0:h0 + 8].transpose(-1, -2) / math.sqrt(D)
                if causal:
                    s = s.masked_fill(torch.arange(total, device=dev)[None, :] > pos[sample][:, None], float("-inf"))
                ref = torch.softmax(s, -1) @ vr[:, h0:h0 + 8]
                got = out[:, sample].float().transpose(1, 2)[:, h0:h0 + 8]
                num += float((got - ref).pow(2).sum())
                den += float(ref.pow(2).sum())
            rel_err = math.sqrt(num / den)

            # The same per-GPU work on one GPU: this rank's queries over all keys.
            qt = q.transpose(1, 2)
            kt, vt = kf.transpose(1, 2), vf.transpose(1, 2)
            eng_out = torch.empty_like(q)

            def engine():
                if not causal:
                    loom.attention(q, kf, vf, eng_out)
                else:  # each zigzag half: causal over the keys up to its chunk's end (bottom-right)
                    half = S // 2
                    for h, chunk in ((0, rank), (1, 2 * world - 1 - rank)):
                        end = (chunk + 1) * half
                        loom.attention(q[:, h * half:(h + 1) * half], kf[:, :end], vf[:, :end],
                                       eng_out[:, h * half:(h + 1) * half], causal=True)

            def cudnn():
                if not causal:
                    return sdpa_cudnn(qt, kt, vt, False)
                half = S // 2
                for h, chunk in ((0, rank), (1, 2 * world - 1 - rank)):
                    end = (chunk + 1) * half
                    sdpa_cudnn(qt[:, :, h * half:(h + 1) * half], kt[:, :, :end], vt[:, :, :end], True)

            def cudnn_with_lse(qh, kh, vh, causal_tl):
                """cuDNN SDPA on [B, H, S, D] views; GQA K/V heads expanded here. Returns O and the
                natural-log LSE [B, H, S] (fp32)."""
                if kh.shape[1] != qh.shape[1]:
                    kh = kh.repeat_interleave(qh.shape[1] // kh.shape[1], 1)
                    vh = vh.repeat_interleave(qh.shape[1] // vh.shape[1], 1)
                o, lse_b = torch.ops.aten._scaled_dot_product_cudnn_attention(
                    qh, kh, vh, None, True, 0.0, causal_tl, False)[:2]
                return o, lse_b.reshape(qh.shape[0], qh.shape[1], qh.shape[2]).float()

            ring_out = torch.empty(B, H, S, D, device=dev, dtype=torch.float32)
            ring_lse = torch.empty(B, H, S, device=dev, dtype=torch.float32)

            def merge_into(rows_, o, lse_b):
                acc, run = ring_out[:, :, rows_], ring_lse[:, :, rows_]
                new = torch.logaddexp(run, lse_b)
                ring_out[:, :, rows_] = acc * torch.exp(run - new)[..., None] + o.float() * torch.exp(lse_b - new)[..., None]
                ring_lse[:, :, rows_] = new

            def torch_ring():
                """Returns this rank's O ([B, S, H, D], bf16) of the whole ring."""
                half = S // 2
                ring_out.zero_()
                ring_lse.fill_(float("-inf"))
                cur_k, cur_v = k, v
                for step in range(world):
                    pending = []
                    if step + 1 < world:  # the next chunk travels while this one is computed
                        nxt_k, nxt_v = torch.empty_like(k), torch.empty_like(v)
                        ops = [dist.P2POp(dist.isend, t, (rank + 1) % world) for t in (cur_k, cur_v)]
                        ops += [dist.P2POp(dist.irecv, t, (rank - 1) % world) for t in (nxt_k, nxt_v)]
                        pending = dist.batch_isend_irecv(ops)
                    src = (rank - step) % world
                    kh, vh = cur_k.transpose(1, 2), cur_v.transpose(1, 2)
                    if not causal:
                        merge_into(slice(0, S), *cudnn_with_lse(qt, kh, vh, False))
                    elif step == 0:  # local chunks: plain causal over [chunk rank, chunk 2W-1-rank]
                        merge_into(slice(0, S), *cudnn_with_lse(qt, kh, vh, True))
                    elif src < rank:  # every local query sees the source's first chunk only
                        merge_into(slice(0, S), *cudnn_with_lse(qt, kh[:, :, :half], vh[:, :, :half], False))
                    else:  # only the second local chunk sees the source, all of it
                        merge_into(slice(half, S), *cudnn_with_lse(qt[:, :, half:], kh, vh, False))
                    for w in pending:
                        w.wait()
                    if step + 1 < world:
                        cur_k, cur_v = nxt_k, nxt_v
                return ring_out.transpose(1, 2).to(q.dtype)

            # torch_ring's own accuracy on the same sample rows (its merge is fp32 too).
            tr = torch_ring()[:, sample].float().transpose(1, 2)
            num = den = 0.0
            for h0 in range(0, H, 8):
                s = qs[:, h0:h0 + 8] @ kr[:, h0:h0 + 8].transpose(-1, -2) / math.sqrt(D)
                if causal:
                    s = s.masked_fill(torch.arange(total, device=dev)[None, :] > pos[sample][:, None], float("-inf"))
                ref = torch.softmax(s, -1) @ vr[:, h0:h0 + 8]
                num += float((tr[:, h0:h0 + 8] - ref).pow(2).sum())
                den += float(ref.pow(2).sum())
            torch_ring_err = math.sqrt(num / den)
            del kr, vr, tr

            candidates = {"loom": lambda: loom.ring_attention(comm, q, k, v, out, lse=lse, causal=causal),
                          "attention": engine, "cudnn": cudnn, "torch_ring": torch_ring}
            if world > 1:
                kg = torch.empty(world, *k.shape, device=dev, dtype=k.dtype)
                vg = torch.empty_like(kg)

                def allgather_cudnn():
                    dist.all_gather_into_tensor(kg, k)
                    dist.all_gather_into_tensor(vg, v)
                    if causal:  # back to sequence order
                        kw = lt.zigzag_unshard(list(kg.unbind(0))).transpose(1, 2)
                        vw = lt.zigzag_unshard(list(vg.unbind(0))).transpose(1, 2)
                    else:
                        kw = kg.permute(1, 0, 2, 3, 4).reshape(B, total, Hkv, D).transpose(1, 2)
                        vw = vg.permute(1, 0, 2, 3, 4).reshape(B, total, Hkv, D).transpose(1, 2)
                    if not causal:
                        return sdpa_cudnn(qt, kw, vw, False)
                    half = S // 2
                    for h, chunk in ((0, rank), (1, 2 * world - 1 - rank)):
                        end = (chunk + 1) * half
                        sdpa_cudnn(qt[:, :, h * half:(h + 1) * half], kw[:, :, :end], vw[:, :, :end], True)

                candidates["allgather_cudnn"] = allgather_cudnn
            medians = time_shuffled(candidates, args.warmup, args.iters, before_each=dist.barrier)  # same order on every rank
            comm.synchronize()
            med = torch.tensor(list(medians.values()), device=dev)
            if world > 1:
                dist.all_reduce(med, op=dist.ReduceOp.MAX)
            ms = dict(zip(medians, med.tolist()))
            rows.append({"op": "ring_attention", "dtype": "bf16", "B": B, "S": S, "H": H, "H_kv": Hkv, "D": D,
                         "causal": causal, "rel_err": rel_err, "torch_ring_rel_err": torch_ring_err, "ms": ms})
            if rank == 0:
                print(f"[{len(rows)}] B{B} S_l{S} H{H}/{Hkv} D{D} {'causal' if causal else 'full'}: "
                      + " ".join(f"{n} {t:.3f}" for n, t in ms.items())
                      + f" rel_err {rel_err:.2e} (torch_ring {torch_ring_err:.2e})", flush=True)
            del qf, kf, vf, q, k, v, out
            torch.cuda.empty_cache()

    if rank == 0:
        result = {"git_sha": git_sha(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "gpu": torch.cuda.get_device_name(), "host": socket.gethostname(), "world": world, "nodes": 1,
                  "command": " ".join(sys.argv), "rows": rows}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

        def tflops(r, t):
            f = 4.0 * r["B"] * r["H"] * r["S"] * world * r["S"] * r["D"] * (0.5 if r["causal"] else 1.0)
            return f / (t * 1e-3) / 1e12

        cols = ["loom", "attention", "cudnn", "torch_ring"] + (["allgather_cudnn"] if world > 1 else [])
        print(f"\nW = {world}, TFLOP/s per GPU")
        print(f"{'shape':<26}{'mask':<8}" + "".join(f"{c:>16}" for c in cols) + f"{'loom/attention':>16}{'rel_err':>10}")
        for r in rows:
            cells = "".join(f"{tflops(r, r['ms'][c]):16.0f}" for c in cols)
            ratio = r["ms"]["attention"] / r["ms"]["loom"]
            shape = f"B{r['B']} S_l{r['S']} H{r['H']}/{r['H_kv']} D{r['D']}"
            print(f"{shape:<26}{'causal' if r['causal'] else 'full':<8}{cells}{ratio:16.3f}{r['rel_err']:10.2e}")
    comm.close()
    dist.destroy_process_group()
    sys.exit(1 if any(not (r["rel_err"] <= 2e-2 and r["torch_ring_rel_err"] <= 2e-2) for r in rows) else 0)


if __name__ == "__main__":
    main()
