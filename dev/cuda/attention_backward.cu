// Causal GQA attention backward: validation against a CPU reference, a determinism check, and timing.
//
//   inputs:  qkv (B, T, (H + 2 KV) hd), out (B, T, H hd), dout (B, T, H hd), lse (B, H, T) fp32
//   output:  dqkv (B, T, (H + 2 KV) hd), every element overwritten
//   P_ij = exp(s_ij - lse_i), s_ij = q_i . k_j / sqrt(hd) (j <= i);  D_i = dout_i . out_i
//   dS_ij = P_ij (dout_i . v_j - D_i);  dq_i = sum_j dS_ij k_j / sqrt(hd);  dk_j = sum_i dS_ij q_i / sqrt(hd);
//   dv_j = sum_i P_ij dout_i   (dk, dv also summed over the query heads of a kv head's group)
//
// The inputs out and lse come from the CPU forward (out rounded through floatX), so the backward is tested alone;
// the reference uses the same rounded out for D, as the GPU does. fp64 accumulation throughout. Every version must
// also be deterministic: a rerun into a freshly poisoned buffer is compared bit for bit.
//
// Versions (v1 and v10 from llmc/, v2-v9 in this file and its headers; TFLOP/s = 2.5 x 2 B H T^2 hd / time, H200,
// shapes of the timing table):
//   v1: attention_backward_scalar: CUDA-core fp32 dq and dk/dv kernels (any precision, hd 1..128).
//       Measured: 14-18 TFLOP/s on the three timing shapes.
//   v2: the tensor-core kernels of attention_backward_tc (FlashAttention-2 style: a dK/dV kernel per key tile and kv
//       head, a dQ kernel per query tile and head, mma.sync m16n8k16 bf16) for hd 64 and 128 (bf16 build only; other
//       head dims fall back to v1), 16 rows per warp (MT 1) in both kernels; dQ: 64 keys per tile; dK/dV: 64 queries
//       per tile (hd 64), 32 (hd 128). Measured on an NVIDIA H200 (B, T, H, KV, hd):
//         (4, 2048, 32, 8, 64):  152 TFLOP/s
//         (2, 4096, 32, 8, 128): 180 TFLOP/s
//         (1, 8192, 32, 8, 128): 187 TFLOP/s
//   v3: attention_backward until v4: the same kernels with per-head-dim tile configurations. dQ: 32
//       queries per warp (MT 2: each K / V fragment loaded with ldmatrix feeds 4 mmas instead of 2), 64 keys per tile
//       (hd 64, 254 registers) or 32 (hd 128, 255 registers, no spill). dK/dV: 16 keys per warp, 64 queries per
//       tile (hd 64: 240 registers; hd 128: 255, 28 bytes spilled). smem dQ 72 / 102 KiB, dK/dV 55 / 103 KiB.
//       Measured on an NVIDIA H200:
//         (4, 2048, 32, 8, 64):  168 TFLOP/s
//         (2, 4096, 32, 8, 128): 208 TFLOP/s
//         (1, 8192, 32, 8, 128): 214 TFLOP/s
//       Other configurations tried (./attention_backward sweep), same shapes: dK/dV with 32 keys per warp (MT 2, 32
//       queries per tile; hd 64 spills 48 bytes): 128-137 at hd 64; dK/dV hd 128 with 32 queries per tile: 194, 200;
//       dQ hd 128 with MT 1: 191, 198 (64 keys), 183, 186 (32 keys); dQ hd 64 with 32 keys: 166; dK/dV hd 64 with 32
//       queries: 148. dK/dV with MT 2 at hd 128 would need 256 accumulator registers: out of reach in this design.
//   v4: attention_backward_tc (what the trainer ran until v5; v3 stays as a fixed entry): for hd 128 the dK/dV
//       kernel is the 8-warp attention_backward_dkdv_tc8_kernel (FA2's backward layout): 128 keys per CTA, warp
//       pairs share 32 keys; the two warps of a pair split S^T / dP^T by query halves and dK / dV by column halves
//       (HD fp32 accumulator registers each, as before), exchanging P^T, dS^T through smem (stmatrix, pair barrier):
//       ~2.5 mma per ldmatrix instead of ~1.8. 64 queries per tile, 3 stages, one CTA per SM, 255 registers (8 bytes
//       spilled), 207.5 KiB smem. Pairs 2, 3 run half a step behind pairs 0, 1 (they finish item it - 1 before
//       scoring item it), so the two warps of an SM sub-partition do not reach the exponentials together. hd 64 keeps
//       v3's kernels. dQ unchanged. Measured on an NVIDIA H200 (same session as the v3 line below):
//         (4, 2048, 32, 8, 64):  167 TFLOP/s   (v3 167)
//         (2, 4096, 32, 8, 128): 209 TFLOP/s   (v3 205)
//         (1, 8192, 32, 8, 128): 219 TFLOP/s   (v3 212)
//       In attention_vs_pytorch.py (fwd+bwd TFLOP/s, two runs of the same session, --iters 20), v3 -> v4:
//       hd 128 T 4096: 228 -> 245, T 8192: 234 -> 253 (PyTorch flash 253, 282): the gain there is larger than in
//       this benchmark's backward-only timing.
//       Tried (./attention_backward sweep): the 8-warp kernel without the skew (pairs in lockstep, one
//       __syncthreads per tile): 140, 188, 194 TFLOP/s, below v3, because with one CTA per SM every warp reaches
//       the exponentials at the same time and the tensor units idle (v3's two CTAs per SM drift apart); the skew
//       alone gives +12%. With the skew at hd 64: 144 (the mma phases are too short to cover the other warp's
//       exponentials), so hd 64 stays on the 4-warp kernel. 32 queries per tile (no skew): 138, 187, 193.
//       Tried after v4 and not kept (the code is not in the tree): the same skew in the dQ kernel, as an 8-warp dQ
//       kernel (one CTA of 256 queries per SM instead of two of 128; warps 4-7 half a key tile behind warps 0-3;
//       MT 2; K/V in 3 stages; 253 / 252 registers, no spill). NVIDIA H200, same session as v4 at 168.0 / 210.4 /
//       218.4: skewed 160.9 / 205.7 / 215.4; in lockstep 162.9 / 206.9 / 214.7; skewed with 32 keys per tile at
//       hd 64: 159.4 / 207.4 / 216.7 TFLOP/s. Fwd+bwd, dQ 4 -> 8 warps: 192.5 -> 188.4, 263.7 -> 260.9,
//       271.6 -> 273.2 (noise). The skew buys nothing here: the dQ kernel's two CTAs per SM already drift apart
//       (the dK/dV gain came from replacing one lockstep CTA per SM), and the larger query tile wastes more work
//       at the diagonal.
//   v4 is kept as a fixed entry (attention_backward_tc: the mma.sync kernels as configured above).
//   v5: what the trainer ran until v10, now backward_hopper_config with v5's choices (below; its kernels load their
//       own tiles with cp.async, dev/cuda/wgmma_cp_async.cuh); then attention_backward_wgmma (now in
//       llmc/attention_wgmma_backward.cuh; sm_90a, hd 64 and 128; elsewhere v1). The same deterministic two-kernel
//       split with wgmma: 2 warpgroups of 64 rows per CTA, 128-byte-swizzled smem tiles read by descriptors, P^T / dS^T
//       (dS in the dQ kernel) fed to the next wgmma from registers. dK/dV: 128 keys per CTA, items of 64 queries
//       through 4 cp.async stages, dK's wgmma left running into the next item. dQ: 128 queries per CTA, K / V tiles
//       of 128 keys (hd 64) or 64 keys (hd 128, with Q and dO held in registers as A fragments). Registers: dK/dV
//       203 (hd 64) / 254 (hd 128), dQ 214 / 246, no spills. Measured on an NVIDIA H200:
//         (4, 2048, 32, 8, 64):  217 TFLOP/s   (v4 167)
//         (2, 4096, 32, 8, 128): 338 TFLOP/s   (v4 209)
//         (1, 8192, 32, 8, 128): 356 TFLOP/s   (v4 219)
//       Steps (same three shapes, each line one H200 session): first version (3 stages, dK waited for within its
//       item, dQ with 64-key tiles): 202 / 318 / 333; + dK running into the next item (4 stages): 211 / 331 / 338;
//       + 128-key dQ tiles at hd 64: 217 / 330 / 344; + Q, dO in registers in the hd 128 dQ kernel: 217 / 338 / 356.
//       Tried and not kept (./attention_backward sweep): the forward's ping-pong (warpgroups take turns issuing, named
//       barriers) in both kernels: 197 / 318 / 333 alone, 201 / 313 / 328 with the deferred dK (the enforced
//       alternation costs more than it overlaps); K and V in registers in the hd 64 dK/dV kernel (halves its smem reads
//       for S^T, dP^T, but ptxas serialises its wgmmas, C7515): 210 vs 217; Q, dO in registers at hd 64: 209 vs 210. At
//       hd 64 the softmax work per item is as large as at hd 128 for half the matmul, so the exponentials (twice per
//       score: once per kernel) limit it; the next steps would be one pass (dQ by ordered fp32 accumulation across key
//       tiles, FA3's deterministic mode) and a producer warp with TMA.
//   v6: attention_backward_v6 (attention_backward_v6.cuh, shared with attention_lib.cu; the design in its header):
//       that one pass. One kernel per (128-key tile, kv head, batch), v5's dK/dV kernel (2 warpgroups x 64 keys,
//       items of 64 queries, here from the last query tile down to the diagonal, 3 cp.async stages) that
//       also writes each warpgroup's dS^T (bf16) to smem and computes the item's dQ partial dS K over its 128 keys
//       (warpgroup w: columns w hd / 2 .., wgmma m64n(hd/2)k16, A = dS^T read transposed, B = K MN-major). The
//       partials are added into an fp32 dQ accumulator (caller scratch) in key-tile order (a counter per (b, h,
//       query tile, column half): spin on an acquire load, read-add-write, threadfence, release add; key tile 0
//       stores without reading, the diagonal key tile writes bf16 dq straight into dqkv). Deterministic: fixed order,
//       fixed partials. 5 matmuls per score tile instead of 7; the exponentials once. Registers: 201 (hd 64) / 250
//       (hd 128), no spills; smem 97.5 / 178.5 KiB. Correct on every validation shape and bit-for-bit
//       deterministic, but slow. Measured on an NVIDIA H100 (v5 in the same run: 217 / 338 / 358):
//         (4, 2048, 32, 8, 64):   88 TFLOP/s
//         (2, 4096, 32, 8, 128): 121 TFLOP/s
//         (1, 8192, 32, 8, 128): 126 TFLOP/s
//       Why: each item's ordered add (the spin on the counter, a latency-bound read-add-write of 16-32 KiB through L2,
//       the fence and the release) runs on the consumer warpgroups between their matmuls, and the next key tile's
//       CTA waits for it, so its latency (microseconds) is paid once per item on the critical path, where an item's
//       five matmuls take about 2-3 us. The next step (FA3's): stage the fp32 partial in smem and let a separate
//       writer warp do the ordered adds while the consumers go on with the next item.
//   Tried after v6, not in the tree (branch bwd7): that writer (3 warpgroups, setmaxnreg 240 / 24; consumers stage
//       the fp32 partial in smem and arrive on an mbarrier, a writer warpgroup does the ordered adds as TMA bulk fp32
//       reduce-adds). On an H100 it validated on the shapes with one key tile (T = 13, 100) and hung at T = 257 (three
//       key tiles: the first shape where CTAs wait on each other), so the hand-off between the writer's counter
//       wait and the consumers' mbarriers needs another look before it can be timed.
//   What bounds a one-pass backward (measured on an NVIDIA H100, same session as v5 at 216 / 337 / 345 TFLOP/s):
//       v6 built with -DV6_DQ_MODE=1 (the dQ partials computed but never added anywhere; results wrong, timing only):
//       305 / 562 / 598 TFLOP/s, so the one-pass work itself (S, dP and the exponentials once, 5 matmuls per score
//       tile) runs 1.4-1.7x faster than v5. With -DV6_DQ_MODE=2 (each thread adds its partial into the fp32
//       accumulator with float2 atomics, unordered, not deterministic): 219 / 298 / 322. The dQ partials are the
//       cost: one 64-query x hd fp32 partial per (item, 128-key tile), 4.4 GB at (1, 8192, 32, 8, 128), which L2 adds
//       at about 1.0-1.4 TB/s whichever way they arrive (atomics, or bulk reduce-adds below).
//   v7: attention_backward_v7 (attention_backward_v7.cuh, its header has the design and the bound): v6 with dQ in
//       fixed point. Each row's partials are scaled by a power of two from a bound on |dq_i| (2 |do_i| max|v|_2
//       max|k|_inf, times 2) and rounded to integers, which L2 adds with one TMA bulk reduce-add per (item, warpgroup)
//       into a tile-ordered accumulator; integer addition is associative, so the result is bit-exact in any order and
//       no CTA waits for another. The last contributor to a tile (a counter per tile) converts it to bf16 dq and
//       zeroes it, so the scratch is left zeroed. Correct on every validation shape, bit-for-bit deterministic,
//       compute-sanitizer memcheck clean; but slower than v5. Measured on an NVIDIA H100 (v5 in the same run: 219 /
//       341 / 349):
//         int64 accumulator (the default; hd 128 with 2 Q / dO stages for smem): 126 / 169 / 188 TFLOP/s
//         int32 accumulator (-DV7_ACC=int -DV7_STAGES_128=3; 2^-29 of the bound per partial): 152 / 251 / 278
//       With -DV7_EXPERIMENT=1 (no completion wait, no conversion; results wrong, timing only): int64 181 / 203 /
//       224, int32 214 / 324 / 357. So even with nothing waiting, the L2 reduce traffic (8.7 GB int64, 4.4 GB int32
//       at the largest shape) holds a one-pass backward at or below v5 on an H100. Next: halve that traffic.
//   v8: attention_backward_v8 (attention_backward_v8.cuh): v7 with the CTAs of key tiles 2m and 2m + 1 as a cluster
//       (1, 2, 1) walking the same items; on each common item one rank reads the other's fixed-point partial through
//       DSMEM, adds it (exact) and sends one bulk reduce for the pair (half the L2 traffic: 2.2 GB int32 at the
//       largest shape). int32 accumulator (int64 does not fit in smem beside the send tiles at hd 128). Correct and
//       bit-for-bit deterministic on every validation shape; slower still. Measured on an NVIDIA H100 (v5 219 / 338 /
//       347 in the same runs):
//         one cluster barrier per item (barrier.cluster arrive + wait):                104 / 152 / 164 TFLOP/s
//         split barrier (the sending rank never waits) + the counter's atomic and the bulk completion deferred to the
//         sum after next:                                                               108 / 154 / 166
//       Timing-only builds (-DV8_EXPERIMENT, first version; results wrong): no per-item barrier 141 / 232 / 260;
//       neither barrier nor DSMEM reads 157 / 272 / 307. The pair's coupling is what costs: the adding rank has to
//       wait for its partner to finish the same item, every item, so the two SMs run in lockstep plus the barrier's
//       latency; and even with no coupling the per-item accumulation work stays above what the one pass saves.
//   v9: v5's two kernels with the dQ kernel launched on a second stream (event fork / join), so the tails of short
//       causal CTAs of one kernel overlap the other's work; the outputs are disjoint, so the result is v5's. Measured
//       on an NVIDIA H100, two alternating runs each: v5 0.792 / 0.799, 2.046 / 2.040, 3.889 / 3.823 ms; v9 0.778 /
//       0.774, 2.027 / 2.030, 3.903 / 3.846 ms: 2-3% at hd 64, nothing at hd 128. Not taken into llmc (a side stream
//       and two events per call in the trainer for 2% of 12% of the 1B step). Tried again on v10's kernels (H100,
//       three alternating rounds): 334.9-337.6 -> 340.0-340.4 TFLOP/s at hd 64, no change at hd 128, and the 1B step
//       no faster (237.04 / 240.81 / 243.01 ms against 236.27 / 238.83 / 242.21); not kept (dev/NOTES.md).
//   Where this left the backward (H100): the one-pass work runs at 305 / 562 / 598 TFLOP/s with nothing added,
//   and every deterministic way of adding the dQ partials tried so far (ordered fp32 v6, fixed point through L2 v7,
//   pairs through DSMEM v8) loses more than the one pass saves, so the trainer kept v5's two kernels. A one-pass
//   design that wins would need the adds fully off the consumers' path (a producer / writer warpgroup with its own
//   mbarrier ring and several items of slack, FA3's structure) and less traffic than one fp32 partial per 128 keys.
//   v10: attention_backward (what the trainer runs): on Hopper, attention_backward_wgmma
//       (llmc/attention_wgmma_backward.cuh, the design beside each kernel): v5's two kernels, warp-specialised and fed
//       by TMA as the forward is. 384 threads: a producer warpgroup (setmaxnreg 24) loads K / V or Q / dO once and
//       streams the other pair by TMA (64- or 128-row boxes of qkv and dout; in the dK/dV kernel 64 of its threads
//       also copy the item's lse (times log2 e) and D into smem); 2 consumer warpgroups (240 registers) run v5's math
//       and meet only the per-stage full / empty mbarriers, never each other. Why: ncu of v5 on an H100 at
//       (1, 8192, 32, 8, 128) had both kernels at ~52% tensor-pipe utilisation with half the issue slots busy (each
//       thread's cp.async address and swizzle arithmetic) and a __syncthreads per item. dK/dV 58% of v5's time there,
//       dQ 42%. Registers: 168 at launch (384 x 168 = 128 x 24 + 256 x 240), no spills. Correct on every validation
//       shape, bit-for-bit reruns, compute-sanitizer memcheck 0 errors; the same bits as v5 (the 1B's losses match
//       the old build's).
//       Steps, NVIDIA H100, TFLOP/s at the three timing shapes (v5 in the same runs 215-219 / 336-341 / 340-361):
//         first version (dK waited for inside its item):                               242-248 / 394-402 / 399-432
//         + dK left running into the next item at hd 64, the consumers' warpgroup index through a shuffle and
//           mbarrier_wait's loop in PTX (without both, ptxas serialises the kernel's wgmmas once dK runs on, C7515;
//           with them hd 128 is faster too, though there dK still waits inside its item):   259-260 / 415-420 / 423-444
//         + the dQ kernel's warpgroup index through a shuffle:                         262-266 / 427-432 / 424-457
//           (the build before it, in the same runs: 256-258 / 410-413 / 421-439; (1, 8192) moves most between runs)
//       On an NVIDIA H200, the first version: 247 / 400 / 399 (v5 217 / 337 / 353).
//       Tried, not kept: (a) dK running on at hd 128 (with the shuffle and the PTX wait): 382-387 / 406-408 against
//       398-404 / 400-429, the registers it keeps alive (dS^T) crowd the consumers' 240; before the shuffle and
//       the PTX wait, dK running on at both head dims: 232 / 365 / 371 (serialised, C7515); (b) dQ's wgmma left
//       running into the next tile: inside the noise, before and after the shuffle; (c) a 4th dQ stage: no
//       change; (d) lse and D read as float2 pairs in the dK/dV kernel: 186-190 / 318-328 / 344-347 (slower).
//       Then the instruction count (ncu source counters of the hd 64 dK/dV kernel, H100, (4, 2048, 32, 8, 64)): 526
//       instructions per warp and item, against about 200 for the math itself. The rest: about 140 uniform-datapath
//       instructions rebuilding every wgmma descriptor from its address, about 115 for the causal mask (ptxas had
//       turned the mask test inside the unrolled loop into predicated selects, run on every item), and an integer
//       division by the number of query tiles (consumers and producer, per item). Both kernels were issue-bound at
//       hd 64 (1,052 instructions per SM sub-partition and item pair, against 1,024 cycles of wgmma), and the 24
//       registers of the producer spilled (36 / 68 bytes at hd 128). Changes, same results to the bit:
//         + descriptors built once per tile and advanced by the slice offset (ptx.cuh wgmma_desc_advance), the mask
//           branch taken outside the loop (two copies of it), item indices counted instead of divided:
//           H100 262-265 / 427-429 / 426-459 -> 289-290 / 458-460 / 464-496 TFLOP/s (alternating runs, one session);
//           ncu: dK/dV 343 -> 299 us (hd 64), 1.76 -> 1.60 ms (hd 128); dQ 238 -> 229 us, 1.16 -> 1.09 ms; no spills
//         + attention_delta reading rows in 16-byte chunks (attention_common.cuh; it was 68 / 65 us of the
//           backward's 590 / 2,770 us at the first and last shape, now 26 / 47 us): 311-316 / 465-469 / 466-504
//           (H100), 321 / 475 / 484-490 (H200; v10 before both changes 267-270 / 432-438 / 441-463 in the same runs).
//       Tried after them, not kept: dK running on at hd 128 (421-422 / 427-451 against 459-464 / 456-501: still the
//       registers); the dQ kernel at hd 128 with Q, dO from shared memory (BN 64: 463-464 / 455-500; BN 128 with 2
//       stages: 462-466 / 466-477) or with 2 stages (459-462 / 463-481): all inside the noise of the kept one; D
//       computed by the dQ kernel's consumers from dout and out (the dQ kernel first, then dK/dV; no delta pass):
//       311-314 / 467-471 / 479-499 against 311-313 / 465-469 / 472-504, no gain for the extra code.
//       Then turns at hd 64. ncu (H100, fast-math build as the trainer's) had both hd 64 kernels at about 51%
//       tensor-pipe utilisation (hd 128: dK/dV 72%, dQ 82%) with 43-45% of the issue slots busy: an item's
//       exponentials and dS^T (about 330 instructions per warp and item) take as long as its products, and two
//       consumers that reach them at the same time leave the tensor pipe idle. Change, same bits (the 1B's losses
//       over 20 steps identical to the old build's):
//         + at hd 64 the dK/dV consumers take turns issuing (named barriers, as in the forward): item i's S^T, dP^T
//           and item i - 1's dV, dK in one turn, P^T and dS^T in two register sets by item parity; a skipped item
//           runs masked (P^T = 0) so that every turn issues the same groups (with conditional groups ptxas
//           serialised the wgmmas, C7514). H100, five alternating rounds in two sessions' calls, --use_fast_math:
//           hd 64 318.5-325.7 -> 334.3-338.3 TFLOP/s; ncu dK/dV 351 -> 319 us (with the early lse copy below).
//           hd 128 keeps issuing per product: two items' P^T, dS^T and the accumulators would need 256 registers.
//       Tried with it, not kept: the same turns in the dQ kernel at hd 64 (with 64-key tiles, for the registers):
//       322-323 against 319-326 (the dK/dV turns alone 335-336, both 335-339); the lse / D copy loaded before its
//       stage is free: 333-343 against 334-338; the wait for item i - 1's dV, dK moved to the next turn, after its
//       mbarrier wait (as the forward's hd 64 wait, so that ptxas keeps P^T, dS^T before it): 334.5-334.8 against
//       337.1-340.7.
//       Then K in registers at hd 128. ncu (H100, (1, 8192, 32, 8, 128)): the dK/dV kernel's busiest unit is the
//       shared pipe (71.7%; dQ 82.1%): S^T and dP^T are m64n64 products with both operands in shared memory. K held
//       in registers as S^T's A (RS wgmma) spilled in the old schedule (140 bytes for all 8 k16 slices, 16 for 2;
//       the consumers are at their 240 registers). Change:
//         + dV and dK issued together once dS^T is ready (no longer dV as soon as P^T is), so that dV's A registers
//           and S^T, dP^T are not live at once; K's first 5 k16 slices in registers (6 spill; all 8: 56 bytes and
//           serialised wgmmas, C7512). H100, three alternating rounds, --use_fast_math, hd 128 shapes:
//           (2, 4096) 473-478 -> 492-495 TFLOP/s, (1, 8192) 469-512 -> 492-529; the new schedule without K in
//           registers: 465-468 / 457-500 (no gain alone); 4 slices: 488-489 / 481-527. Validation, bit-for-bit
//           reruns, memcheck and synccheck pass; make test passes (the hd 128 tie-outs: test-mha, 3B-d2).
//       Then (session 22) the dQ kernel persistent, as the forward at hd 64: one CTA per SM takes the query tiles in
//       the forward's longest-first order, with two (Q, dO) buffers (they fit at both head dims), so the next
//       item's Q and dO load while this one's last tiles and stores run. H100, two alternating rounds of the old
//       and new binaries: 337.1-337.7 -> 346.9-347.5 / 490.9-491.9 -> 490.4-494.1 / 511.8-517.7 -> 522.2-523.8.
//       Then (session 23) its items handed out in the snake order (llmc's persistent_item) instead of at a fixed
//       stride, which gave CTA 0 the longest item of every round. H100, two alternating rounds: 345.5, 348.1 ->
//       350.1, 348.6 / 493.1, 493.8 -> 502.2, 502.7 / 515.9, 503.8 -> 535.7, 519.0 TFLOP/s.
//       Then both kernels in pipeline.cuh's vocabulary (rings counted rather than divided, the shared memory as a
//       struct; llmc/attention_wgmma_backward.cuh): the same bits, and no spills in the hd 128 dQ kernel any more
//       (20 bytes stored, 44 loaded before). H100, 8 runs each in ABBA order, medians: 352.2 -> 353.1 / 492.2 ->
//       488.8 / 477.6 -> 477.7 TFLOP/s (hd 128 spreads over 461-502 in both).
//   v11: v10 given RoPE's table, as the trainer calls it: RoPE's backward on dq and dk applied as the kernels store
//       them (llmc/attention_wgmma.cuh wgmma_store_rows), so the trainer's separate rope_backward pass over dqkv is
//       gone. Validated against the CPU reference followed by the CPU RoPE backward, and bit for bit against v10
//       followed by llmc's rope_backward; timed next to that pair. H100 (session 20, one run, the three timing
//       shapes): v11 0.524 / 1.429 / 2.672 ms against v12 (v10 + rope_backward) 0.542 / 1.471 / 2.952 ms.
// Side by side with PyTorch SDPA: attention_vs_pytorch.py (--backward v6 for this version).
//
// Build: nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a [-DENABLE_FP32] attention_backward.cu
// Run:   ./attention_backward [version]     (no argument: every version; the fp32 build has only v1)
//        ./attention_backward 6 check       (validation only, no timing: for compute-sanitizer)
//        ./attention_backward 7 time [i]    (timing only, every timing shape or shape i: for ncu)
//        ./attention_backward 10 time [i]   (timing only, every timing shape or shape i: for ncu)
//        ./attention_backward sweep         (bf16: other tile configurations, spot-validated and timed)
#include "common.h"

#include "../../llmc/attention.cuh"
#include "../../llmc/model.h"
#include "../../llmc/ptx.cuh"
#include "wgmma_cp_async.cuh"
#include "attention_backward_v6.cuh"
#include "attention_backward_v7.cuh"
#include "attention_backward_v8.cuh"
#include "attention_shapes.h"

// ---------------------------------------------------------------------------------------------------------------
// CPU reference: cpu::attention_forward and cpu::attention_backward (dev/cpu/llama3_cpu.h)

// Splits a (B, T, (H + 2 KV) hd) tensor into its query, key and value parts, each (B, T, heads * hd).
static void split_qkv(const std::vector<float>& x, int B, int T, int H, int KV, int hd, std::vector<float>& q,
                      std::vector<float>& k, std::vector<float>& v) {
    const size_t stride = (size_t)(H + 2 * KV) * hd, nq = (size_t)H * hd, nk = (size_t)KV * hd;
    q.clear(); k.clear(); v.clear();
    for (size_t t = 0; t < (size_t)B * T; t++) {
        const float* row = &x[t * stride];
        q.insert(q.end(), row, row + nq);
        k.insert(k.end(), row + nq, row + nq + nk);
        v.insert(v.end(), row + nq + nk, row + stride);
    }
}

#if !defined(ENABLE_FP32)
// ---------------------------------------------------------------------------------------------------------------
// v2-v4: the mma.sync backward (FlashAttention-2 style; conventions in llmc/attention_mma.cuh and llmc/ptx.cuh).
// D = rowsum(dO o O) by attention_delta, then a dK/dV kernel per key tile and kv head and a dQ kernel per query tile
// and head, every output element with one writer (deterministic, no atomics):
//   dK/dV: CTA = (64 MT keys, kv head, batch); warp w owns keys k0 + 16 MT w ..; the K, V tiles stay in smem. Loops
//     over the group's query heads and, for each, over query tiles of BQ from the diagonal to T (2-stage cp.async
//     pipeline of Q, dO, and plain loads of lse, D). Per tile and warp, transposed (rows = the warp's keys, columns =
//     queries): S^T = K Q^T and dP^T = V dO^T; P^T = exp2(S^T scale log2 e - lse log2 e), set to 0 where
//     key > query or query >= T; dS^T = P^T o (dP^T - D); dV += P^T dO and dK += dS^T Q, with P^T and dS^T reused
//     from the accumulators as A fragments. dK is multiplied by scale once, at the store.
//   dQ: CTA = (64 MT queries, head, batch); warp w owns 16 MT queries; Q, dO stay in smem; K, V tiles of BN keys up
//     to the diagonal through the 2-stage pipeline; recomputes S, P, dP, dS per tile and accumulates dQ += dS K.
//   dK/dV, 8 warps (v4 at hd 128): CTA = 128 keys; warp pairs share 32 keys, described above its kernel.
// No pre-Hopper GPU was at hand to test these on, so llmc/ runs the scalar backward off Hopper.

// cp.async loads of rows [r0, r0 + ROWS) of one head into a (ROWS, HD + 8) smem tile by a CTA of NTHREADS threads
// (llmc/attention_mma.cuh's mma_load_tile, for any CTA size).
template <int HD, int ROWS, int NTHREADS>
__device__ __forceinline__ void mma_load_tile_n(__nv_bfloat16* dst, const __nv_bfloat16* src, size_t row_stride, int r0,
                                                int T) {
    constexpr int CHUNKS = HD / 8, LD = HD + 8;
    static_assert((ROWS * CHUNKS) % NTHREADS == 0, "tile must split evenly over the CTA");
#pragma unroll
    for (int i = 0; i < ROWS * CHUNKS / NTHREADS; i++) {
        const int idx = i * NTHREADS + threadIdx.x;
        const int r = idx / CHUNKS, c = idx % CHUNKS;
        const bool valid = r0 + r < T;
        const __nv_bfloat16* g = src + (size_t)(valid ? r0 + r : 0) * row_stride + 8 * c;
        cp_async_16(smem_addr(dst + r * LD + 8 * c), g, valid ? 16 : 0);
    }
}

// CTA rows (queries here; keys in dK/dV) for MT m16 tiles per warp.
template <int MT>
__host__ __device__ constexpr int mma_cta_rows() {
    return 16 * MT * MMA_WARPS;
}
// The backward's two score-shaped products over the head dim, sharing one loop: s = A1 B1^T and dp = A2 B2^T.
// A1, A2: the warp's MT 16-row blocks from row0; B1, B2: N rows; all HD wide, in shared memory with leading
// dimension LD (32-bit shared addresses). The dK/dV kernel passes (K, V, Q, dO) to get S^T and dP^T, the dQ kernel
// (Q, dO, K, V) to get S and dP. Each B fragment feeds MT mmas.
template <int HD, int MT, int N, int LD>
__device__ __forceinline__ void mma_two_products(float (&s)[MT][N / 8][4], float (&dp)[MT][N / 8][4], uint32_t a1,
                                                 uint32_t a2, uint32_t b1, uint32_t b2, int row0, int lane) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int nt = 0; nt < N / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) s[mt][nt][e] = dp[mt][nt][e] = 0.0f;
        }
    }
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        uint32_t fa1[MT][4], fa2[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            ldmatrix_x4(fa1[mt], a1 + ldmatrix_off_a<LD>(row0 + 16 * mt, 16 * kk, lane));
            ldmatrix_x4(fa2[mt], a2 + ldmatrix_off_a<LD>(row0 + 16 * mt, 16 * kk, lane));
        }
#pragma unroll
        for (int np = 0; np < N / 16; np++) {
            uint32_t fb[4];
            ldmatrix_x4(fb, b1 + ldmatrix_off_b<LD>(16 * np, 16 * kk, lane));
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_m16n8k16_bf16(s[mt][2 * np], fa1[mt], fb[0], fb[1]);
                mma_m16n8k16_bf16(s[mt][2 * np + 1], fa1[mt], fb[2], fb[3]);
            }
            ldmatrix_x4(fb, b2 + ldmatrix_off_b<LD>(16 * np, 16 * kk, lane));
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_m16n8k16_bf16(dp[mt][2 * np], fa2[mt], fb[0], fb[1]);
                mma_m16n8k16_bf16(dp[mt][2 * np + 1], fa2[mt], fb[2], fb[3]);
            }
        }
    }
}
template <int HD, int MT, int BQ>
constexpr size_t backward_dkdv_mma_smem_bytes() {
    return sizeof(__nv_bfloat16) * (HD + 8) * (2 * mma_cta_rows<MT>() + 4 * BQ) + sizeof(float) * 4 * BQ;
}

// dk, dv for one (b, kv head, tile of 64 MT keys). grid (B * KV, ceil(T / (64 MT))), block 128.
// MT: m16 key tiles per warp; BQ: queries per streamed Q/dO tile.
template <int HD, int MT, int BQ>
__global__ void __launch_bounds__(MMA_THREADS, 2)
    backward_dkdv_mma_kernel(__nv_bfloat16* dqkv, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                                      const float* lse, const float* delta, int T, int H, int KV, float scale,
                                      float scale_log2) {
    constexpr int LD = HD + 8, ROWS = mma_cta_rows<MT>(), WR = 16 * MT;
    static_assert(ROWS % BQ == 0, "query tiles must start at the key tile's first key");
    extern __shared__ int4 mma_smem_dkdv[];
    __nv_bfloat16* Ks = reinterpret_cast<__nv_bfloat16*>(mma_smem_dkdv);  // (ROWS, LD)
    __nv_bfloat16* Vs = Ks + ROWS * LD;                                    // (ROWS, LD)
    __nv_bfloat16* Qs = Vs + ROWS * LD;                                    // 2 stages x (BQ, LD)
    __nv_bfloat16* dOs = Qs + 2 * BQ * LD;                                 // 2 stages x (BQ, LD)
    float* lse2_s = reinterpret_cast<float*>(dOs + 2 * BQ * LD);           // 2 stages x BQ: lse log2(e)
    float* D_s = lse2_s + 2 * BQ;                                          // 2 stages x BQ: delta

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = 2 * (lane % 4);
    const int b = blockIdx.x / KV, kvh = blockIdx.x % KV, group = H / KV;
    const int k0 = blockIdx.y * ROWS;  // the first key tiles see the most queries: scheduled first
    const int kw = k0 + WR * warp;     // the warp's first key
    const size_t stride = (size_t)(H + 2 * KV) * HD, o_stride = (size_t)H * HD;
    const __nv_bfloat16* k_src = qkv + (size_t)b * T * stride + (size_t)(H + kvh) * HD;
    const __nv_bfloat16* v_src = qkv + (size_t)b * T * stride + (size_t)(H + KV + kvh) * HD;

    // Work items: (query head g_i of the group, query tile from the diagonal), flattened so that one pipeline runs
    // through all of them in a fixed order. k0 is a multiple of ROWS, hence of BQ: queries before k0 see no key here.
    const int n_q = ceil_div(T - k0, BQ), n_items = group * n_q;
    auto issue = [&](int item, int stage) {
        const int h = kvh * group + item / n_q, q0 = k0 + (item % n_q) * BQ;
        mma_load_tile_n<HD, BQ, MMA_THREADS>(Qs + stage * BQ * LD, qkv + (size_t)b * T * stride + (size_t)h * HD,
                                             stride, q0, T);
        mma_load_tile_n<HD, BQ, MMA_THREADS>(dOs + stage * BQ * LD, dout + (size_t)b * T * o_stride + (size_t)h * HD,
                                             o_stride, q0, T);
        const size_t row = ((size_t)b * H + h) * T;  // (b, h) row of lse and delta
        for (int i = threadIdx.x; i < BQ; i += MMA_THREADS) {  // plain loads: visible after the next __syncthreads
            const int q = q0 + i;
            lse2_s[stage * BQ + i] = q < T ? lse[row + q] * ATTN_LOG2E : 0.0f;
            D_s[stage * BQ + i] = q < T ? delta[row + q] : 0.0f;
        }
    };

    mma_load_tile_n<HD, ROWS, MMA_THREADS>(Ks, k_src, stride, k0, T);
    mma_load_tile_n<HD, ROWS, MMA_THREADS>(Vs, v_src, stride, k0, T);
    issue(0, 0);
    cp_async_commit();

    float dk[MT][HD / 8][4], dv[MT][HD / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int nt = 0; nt < HD / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) dk[mt][nt][e] = dv[mt][nt][e] = 0.0f;
        }
    }
    const uint32_t k_base = smem_addr(Ks), v_base = smem_addr(Vs);

    for (int it = 0; it < n_items; it++) {
        const int stage = it % 2;
        if (it + 1 < n_items) {
            issue(it + 1, 1 - stage);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();

        const int q0 = k0 + (it % n_q) * BQ;
        if (kw <= q0 + BQ - 1) {  // warp-uniform: some query of the tile sees some key of the warp
            const uint32_t q_base = smem_addr(Qs + stage * BQ * LD), do_base = smem_addr(dOs + stage * BQ * LD);
            const float* lse2_t = lse2_s + stage * BQ;
            const float* D_t = D_s + stage * BQ;
            // S^T = K Q^T and dP^T = V dO^T: rows are the warp's WR keys, columns the BQ queries. Each Q / dO
            // fragment feeds 2 MT mmas.
            float s[MT][BQ / 8][4], dp[MT][BQ / 8][4];
            mma_two_products<HD, MT, BQ, LD>(s, dp, k_base, v_base, q_base, do_base, WR * warp, lane);
            // P^T, dS^T in place. Element (mt, nt, e): key kw + 16 mt + g + 8 (e / 2), query q0 + 8 nt + c + e % 2.
            // Masking is needed where some query precedes some key of the warp, or the tile runs past T.
            const bool need_mask = q0 < kw + WR - 1 || q0 + BQ > T;
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
#pragma unroll
                for (int nt = 0; nt < BQ / 8; nt++) {
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int qi = 8 * nt + c + e % 2;
                        float p = exp2f(fmaf(s[mt][nt][e], scale_log2, -lse2_t[qi]));
                        if (need_mask) {
                            const int q = q0 + qi, key = kw + 16 * mt + g + 8 * (e / 2);
                            if (key > q || q >= T) p = 0.0f;  // select, not multiply: p may be inf where masked
                        }
                        s[mt][nt][e] = p;
                        dp[mt][nt][e] = p * (dp[mt][nt][e] - D_t[qi]);
                    }
                }
            }
            // dV += P^T dO and dK += dS^T Q: A from the accumulators, the dO and Q tiles as B.
            mma_acc_times_bt<HD, MT, BQ, LD>(dv, s, do_base, lane);
            mma_acc_times_bt<HD, MT, BQ, LD>(dk, dp, q_base, lane);
        }
        __syncthreads();  // all warps done with this stage before the next prefetch overwrites it
    }

    // The warp's own K and V rows are dead now: they stage the bf16 results.
    __nv_bfloat16* dqkv_b = dqkv + (size_t)b * T * stride;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        const int rw = WR * warp + 16 * mt;
        mma_store_warp_rows<HD>(dqkv_b + (size_t)(H + kvh) * HD, stride, Ks + rw * LD, dk[mt], scale, scale,
                                k0 + rw, T, lane);
        mma_store_warp_rows<HD>(dqkv_b + (size_t)(H + KV + kvh) * HD, stride, Vs + rw * LD, dv[mt], 1.0f, 1.0f,
                                k0 + rw, T, lane);
    }
}
// ----------------------------------------------------------------------------------------------------------------
// dK/dV with 8 warps (FA2's backward layout): more mma per ldmatrix at the same accumulator registers.
//
// The 4-warp kernel above gives each warp 16 keys (MT 1) and all HD columns of dK and dV (HD fp32 accumulator
// registers): every Q / dO fragment it loads feeds only 2 mmas (~1.8 mma per ldmatrix overall), and MT 2 would need
// 2 HD accumulator registers. Here the CTA owns 128 keys and 8 warps in 4 pairs; pair p owns keys k0 + 32 p .. + 31
// and its two warps split the work of a query tile of BQ queries two ways:
//   * S^T = K Q^T, dP^T = V dO^T, P^T, dS^T: warp (p, w) takes the 32 keys x its half of the queries (BQ / 2 from
//     q0 + w BQ / 2), MT 2: each Q / dO fragment feeds 4 mmas.
//   * dV += P^T dO, dK += dS^T Q: warp (p, w) takes the 32 keys x its half of the columns (HD / 2 from w HD / 2) over
//     all BQ queries: accumulators 2 x 32 x HD / 2 / 32 = HD registers, as before, and each dO / Q fragment feeds 4
//     mmas. The warp needs P^T, dS^T of its partner's query half too: both warps write theirs (bf16) to shared memory
//     (stmatrix) and meet at a pair barrier (bar.sync with 64 threads); a warp takes its own half from registers.
// Per warp and query tile (HD 128, BQ 64): 256 mmas for 104 ldmatrix (~2.5 per ldmatrix) instead of 144.
// A query half whose queries all precede the pair's keys is skipped by both warps (diagonal tiles).
// Skew: with one 8-warp CTA per SM and a __syncthreads per tile, all warps reach the exponentials together and the
// tensor units idle meanwhile (measured on an H200, HD 128: 188 / 194 TFLOP/s for the whole backward, below the
// 4-warp kernel's 206 / 213, where two CTAs per SM drift apart). So pairs 2, 3 run half a step behind (see the main
// loop): 210 / 217.
// Q, dO (and lse, D, by 4-byte cp.async) stream through 3 stages, prefetched one item ahead (a late pair still reads
// item it - 1's stage while item it is scored); one __syncthreads per item.
// smem: (K, V) 128 x (HD+8) + 3 stages x (Q, dO) BQ x (HD+8) + (P^T, dS^T) 128 x (BQ+8) bf16 + 3 x 2 x BQ fp32.
// 255 registers at most (one CTA of 256 threads per SM, like two CTAs of the 4-warp kernel); HD 128, BQ 64: 255 with
// 8 bytes spilled, smem 207.5 KiB.
constexpr int DKDV8_THREADS = 256, DKDV8_KEYS = 128, DKDV8_STAGES = 3;

template <int HD, int BQ>
constexpr size_t backward_dkdv_mma8_smem_bytes() {
    return sizeof(__nv_bfloat16) * ((HD + 8) * (2 * DKDV8_KEYS + 2 * DKDV8_STAGES * BQ) + 2 * DKDV8_KEYS * (BQ + 8)) +
           sizeof(float) * 2 * DKDV8_STAGES * BQ;
}
// Stores a 16 x 16 bf16 block held as an A fragment (ldmatrix_x4's registers) at (row0, col0) of a row-major smem
// tile with leading dimension LD: one stmatrix.x4 (the inverse of ldmatrix.x4: same addresses, same registers) on
// Hopper, four 32-bit stores before it.
template <int LD>
__device__ __forceinline__ void mma_store_a_frag(uint32_t base, int row0, int col0, const uint32_t (&r)[4], int lane) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                     base + ldmatrix_off_a<LD>(row0, col0, lane)),
                 "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
#else
    const int g = lane / 4, c = 2 * (lane % 4);
#pragma unroll
    for (int i = 0; i < 4; i++) {  // register i: matrix i = rows 8 (i % 2), columns 8 (i / 2) of the block
        const uint32_t addr = base + 2u * ((row0 + g + 8 * (i % 2)) * LD + col0 + c + 8 * (i / 2));
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(r[i]) : "memory");
    }
#endif
}

// Named barrier for `count` threads (a multiple of 32), id 1..15 (0 is __syncthreads).
__device__ __forceinline__ void pair_barrier_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// Stores a warp's 16 x 8 NT fp32 accumulator block (times mult) as bf16: into the same block of a smem tile with
// leading dimension LD (which no other warp touches), then 16-byte chunks to global rows r0 .. r0+15 (dst and stage:
// row 0, column 0 of the block), skipping rows >= T.
template <int LD, int NT>
__device__ __forceinline__ void mma_store_warp_block(__nv_bfloat16* dst, size_t row_stride, __nv_bfloat16* stage,
                                                     const float (&acc)[NT][4], float mult, int r0, int T, int lane) {
    const int g = lane / 4, c = 2 * (lane % 4);
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        *reinterpret_cast<uint32_t*>(stage + g * LD + 8 * nt + c) = pack_bf16x2(acc[nt][0] * mult, acc[nt][1] * mult);
        *reinterpret_cast<uint32_t*>(stage + (g + 8) * LD + 8 * nt + c) =
            pack_bf16x2(acc[nt][2] * mult, acc[nt][3] * mult);
    }
    __syncwarp();
    static_assert((16 * NT) % 32 == 0, "block must split evenly over the warp");
#pragma unroll
    for (int i = 0; i < 16 * NT / 32; i++) {
        const int idx = i * 32 + lane, r = idx / NT, ch = idx % NT;
        if (r0 + r < T) {
            *reinterpret_cast<int4*>(dst + (size_t)(r0 + r) * row_stride + 8 * ch) =
                *reinterpret_cast<const int4*>(stage + r * LD + 8 * ch);
        }
    }
}

// dk, dv for one (b, kv head, tile of 128 keys). grid (B * KV, ceil(T / 128)), block 256. BQ: queries per tile;
// SKEW: pairs 2, 3 half a step behind (false only for comparison).
template <int HD, int BQ, bool SKEW>
__global__ void __launch_bounds__(DKDV8_THREADS, 1)
    backward_dkdv_mma8_kernel(__nv_bfloat16* dqkv, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                                       const float* lse, const float* delta, int T, int H, int KV, float scale,
                                       float scale_log2) {
    constexpr int LD = HD + 8, LDP = BQ + 8, ROWS = DKDV8_KEYS, S = DKDV8_STAGES;
    constexpr int QH = BQ / 2, DH = HD / 2;  // a warp's queries (S^T, dP^T) and columns (dK, dV)
    constexpr int QK = QH / 16;              // 16-query k steps per half
    static_assert(QH % 16 == 0 && DH % 16 == 0 && ROWS % BQ == 0, "tile shapes");
    extern __shared__ int4 mma_smem_dkdv8[];
    __nv_bfloat16* Ks = reinterpret_cast<__nv_bfloat16*>(mma_smem_dkdv8);  // (ROWS, LD)
    __nv_bfloat16* Vs = Ks + ROWS * LD;                                     // (ROWS, LD)
    __nv_bfloat16* Qs = Vs + ROWS * LD;                                     // S stages x (BQ, LD)
    __nv_bfloat16* dOs = Qs + S * BQ * LD;                                  // S stages x (BQ, LD)
    __nv_bfloat16* Ps = dOs + S * BQ * LD;                                  // (ROWS, LDP): P^T of the tile
    __nv_bfloat16* dSs = Ps + ROWS * LDP;                                   // (ROWS, LDP): dS^T of the tile
    float* lse_s = reinterpret_cast<float*>(dSs + ROWS * LDP);              // S stages x BQ
    float* D_s = lse_s + S * BQ;                                            // S stages x BQ

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = 2 * (lane % 4);
    const int pair = warp / 2, half = warp % 2;
    const int b = blockIdx.x / KV, kvh = blockIdx.x % KV, group = H / KV;
    const int k0 = blockIdx.y * ROWS;  // the first key tiles see the most queries: scheduled first
    const int kr = 32 * pair;          // the pair's first key row in the tile
    const int kw = k0 + kr;            // the pair's first key
    const int qoff = QH * half, doff = DH * half;
    const size_t stride = (size_t)(H + 2 * KV) * HD, o_stride = (size_t)H * HD;
    const __nv_bfloat16* k_src = qkv + (size_t)b * T * stride + (size_t)(H + kvh) * HD;
    const __nv_bfloat16* v_src = qkv + (size_t)b * T * stride + (size_t)(H + KV + kvh) * HD;

    // Work items (query head of the group, query tile from the diagonal), as in the 4-warp kernel.
    const int n_q = ceil_div(T - k0, BQ), n_items = group * n_q;
    auto issue = [&](int item, int stage) {
        const int h = kvh * group + item / n_q, q0 = k0 + (item % n_q) * BQ;
        mma_load_tile_n<HD, BQ, DKDV8_THREADS>(Qs + stage * BQ * LD, qkv + (size_t)b * T * stride + (size_t)h * HD,
                                            stride, q0, T);
        mma_load_tile_n<HD, BQ, DKDV8_THREADS>(dOs + stage * BQ * LD, dout + (size_t)b * T * o_stride + (size_t)h * HD,
                                            o_stride, q0, T);
        const size_t row = ((size_t)b * H + h) * T;  // (b, h) row of lse and delta
        attention_load_row_stats<BQ>(lse_s + stage * BQ, D_s + stage * BQ, lse, delta, row, q0, T);
    };

    mma_load_tile_n<HD, ROWS, DKDV8_THREADS>(Ks, k_src, stride, k0, T);
    mma_load_tile_n<HD, ROWS, DKDV8_THREADS>(Vs, v_src, stride, k0, T);
    issue(0, 0);
    cp_async_commit();

    float dk[2][DH / 8][4], dv[2][DH / 8][4];  // keys kw + 16 mt + (g, g+8), columns doff + 8 nt + (c, c+1)
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
#pragma unroll
        for (int nt = 0; nt < DH / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) dk[mt][nt][e] = dv[mt][nt][e] = 0.0f;
        }
    }
    const uint32_t k_base = smem_addr(Ks), v_base = smem_addr(Vs);
    const uint32_t p_base = smem_addr(Ps), ds_base = smem_addr(dSs);

    uint32_t pown[2][QK][4], dsown[2][QK][4];  // this warp's P^T, dS^T of its latest tile, as A fragments
    auto tile_q0 = [&](int it) { return k0 + (it % n_q) * BQ; };
    // A query half is live for the pair if some of its queries see some of the pair's keys (warp-uniform).
    auto half_live = [&](int it, int h) { return tile_q0(it) + QH * h + QH - 1 >= kw; };

    // S^T, dP^T, P^T, dS^T of the warp's query half of item it: into pown / dsown and the pair's rows of Ps / dSs.
    auto score_phase = [&](int it) {
        const int stage = it % S, q0 = tile_q0(it);
        if (!half_live(it, half)) return;
        const uint32_t q_base = smem_addr(Qs + stage * BQ * LD), do_base = smem_addr(dOs + stage * BQ * LD);
        float s[2][QH / 8][4], dp[2][QH / 8][4];
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
#pragma unroll
            for (int nt = 0; nt < QH / 8; nt++) {
#pragma unroll
                for (int e = 0; e < 4; e++) s[mt][nt][e] = dp[mt][nt][e] = 0.0f;
            }
        }
        // S^T = K Q^T, dP^T = V dO^T over the warp's 32 keys x QH queries.
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            uint32_t ka[2][4], va[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                ldmatrix_x4(ka[mt], k_base + ldmatrix_off_a<LD>(kr + 16 * mt, 16 * kk, lane));
                ldmatrix_x4(va[mt], v_base + ldmatrix_off_a<LD>(kr + 16 * mt, 16 * kk, lane));
            }
#pragma unroll
            for (int np = 0; np < QK; np++) {
                uint32_t qb[4], ob[4];
                ldmatrix_x4(qb, q_base + ldmatrix_off_b<LD>(qoff + 16 * np, 16 * kk, lane));
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    mma_m16n8k16_bf16(s[mt][2 * np], ka[mt], qb[0], qb[1]);
                    mma_m16n8k16_bf16(s[mt][2 * np + 1], ka[mt], qb[2], qb[3]);
                }
                ldmatrix_x4(ob, do_base + ldmatrix_off_b<LD>(qoff + 16 * np, 16 * kk, lane));
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    mma_m16n8k16_bf16(dp[mt][2 * np], va[mt], ob[0], ob[1]);
                    mma_m16n8k16_bf16(dp[mt][2 * np + 1], va[mt], ob[2], ob[3]);
                }
            }
        }
        // P^T, dS^T. Element (mt, nt, e): key kw + 16 mt + g + 8 (e / 2), query q0 + qoff + 8 nt + c + e % 2.
        const bool need_mask = q0 + qoff < kw + 31 || q0 + qoff + QH > T;
        const float* lse_t = lse_s + stage * BQ + qoff;
        const float* D_t = D_s + stage * BQ + qoff;
#pragma unroll
        for (int nt = 0; nt < QH / 8; nt++) {
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int qi = 8 * nt + c + j;
                const float l2 = lse_t[qi] * ATTN_LOG2E, Dq = D_t[qi];
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
#pragma unroll
                    for (int r = 0; r < 2; r++) {
                        const int e = 2 * r + j;
                        float p = exp2f(fmaf(s[mt][nt][e], scale_log2, -l2));
                        if (need_mask) {
                            const int q = q0 + qoff + qi, key = kw + 16 * mt + g + 8 * r;
                            if (key > q || q >= T) p = 0.0f;  // select, not multiply: p may be inf where masked
                        }
                        s[mt][nt][e] = p;
                        dp[mt][nt][e] = p * (dp[mt][nt][e] - Dq);
                    }
                }
            }
        }
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
#pragma unroll
            for (int kk = 0; kk < QK; kk++) {
                mma_acc_to_a(pown[mt][kk], s[mt][2 * kk], s[mt][2 * kk + 1]);
                mma_acc_to_a(dsown[mt][kk], dp[mt][2 * kk], dp[mt][2 * kk + 1]);
                mma_store_a_frag<LDP>(p_base, kr + 16 * mt, qoff + 16 * kk, pown[mt][kk], lane);
                mma_store_a_frag<LDP>(ds_base, kr + 16 * mt, qoff + 16 * kk, dsown[mt][kk], lane);
            }
        }
    };

    // dV += P^T dO, dK += dS^T Q over item it's BQ queries, the warp's DH columns (after the pair barrier that
    // follows score_phase(it)).
    auto kv_phase = [&](int it) {
        const int stage = it % S;
        const uint32_t q_base = smem_addr(Qs + stage * BQ * LD), do_base = smem_addr(dOs + stage * BQ * LD);
#pragma unroll
        for (int kk = 0; kk < BQ / 16; kk++) {
            const bool mine = kk / QK == half;
            if (!half_live(it, kk / QK)) continue;  // warp-uniform: that half is all zeros
            uint32_t pa[2][4], dsa[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                if (mine) {
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        pa[mt][i] = pown[mt][kk % QK][i];
                        dsa[mt][i] = dsown[mt][kk % QK][i];
                    }
                } else {
                    ldmatrix_x4(pa[mt], p_base + ldmatrix_off_a<LDP>(kr + 16 * mt, 16 * kk, lane));
                    ldmatrix_x4(dsa[mt], ds_base + ldmatrix_off_a<LDP>(kr + 16 * mt, 16 * kk, lane));
                }
            }
#pragma unroll
            for (int dpr = 0; dpr < DH / 16; dpr++) {
                uint32_t ob[4], qb[4];
                ldmatrix_x4_trans(ob, do_base + ldmatrix_off_bt<LD>(16 * kk, doff + 16 * dpr, lane));
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    mma_m16n8k16_bf16(dv[mt][2 * dpr], pa[mt], ob[0], ob[1]);
                    mma_m16n8k16_bf16(dv[mt][2 * dpr + 1], pa[mt], ob[2], ob[3]);
                }
                ldmatrix_x4_trans(qb, q_base + ldmatrix_off_bt<LD>(16 * kk, doff + 16 * dpr, lane));
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    mma_m16n8k16_bf16(dk[mt][2 * dpr], dsa[mt], qb[0], qb[1]);
                    mma_m16n8k16_bf16(dk[mt][2 * dpr + 1], dsa[mt], qb[2], qb[3]);
                }
            }
        }
    };

    // Skew (SKEW): warps w and w + 4 share an SM sub-partition (one tensor unit); in lockstep both would reach the
    // exponentials at once and leave it idle. So pairs 2, 3 (warps 4-7) run half a step behind pairs 0, 1: in
    // iteration it they finish item it - 1 (kv_phase) before scoring item it, so one warp's exponentials overlap the
    // other's mmas. A late pair reads stages it - 1 and it, so tile it + 1 is prefetched into the third stage, one
    // item ahead; Ps / dSs rows are the pair's own, so only its barrier guards them across the iterations.
    const bool late = SKEW && pair >= 2;
    for (int it = 0; it < n_items; it++) {
        cp_async_wait<0>();  // item it landed
        __syncthreads();         // visible to all; every warp done with item it - 1 (early) or it - 2 (late)
        if (it + 1 < n_items) issue(it + 1, (it + 1) % S);
        cp_async_commit();
        if (late && it > 0) {
            kv_phase(it - 1);
            pair_barrier_sync(1 + pair, 64);  // the partner is done reading item it - 1's P^T, dS^T
        }
        score_phase(it);
        pair_barrier_sync(1 + pair, 64);  // the partner's P^T, dS^T half is in smem
        if (!late) kv_phase(it);
    }
    if (late) kv_phase(n_items - 1);
    pair_barrier_sync(1 + pair, 64);  // the partner is done reading the pair's K, V rows: they stage the results

    __nv_bfloat16* dqkv_b = dqkv + (size_t)b * T * stride;
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
        const int r = kr + 16 * mt;
        mma_store_warp_block<LD, DH / 8>(dqkv_b + (size_t)(H + kvh) * HD + doff, stride, Ks + r * LD + doff, dk[mt],
                                         scale, k0 + r, T, lane);
        mma_store_warp_block<LD, DH / 8>(dqkv_b + (size_t)(H + KV + kvh) * HD + doff, stride, Vs + r * LD + doff,
                                         dv[mt], 1.0f, k0 + r, T, lane);
    }
}
template <int HD, int MT, int BN>
constexpr size_t backward_dq_mma_smem_bytes() {
    return sizeof(__nv_bfloat16) * (HD + 8) * (2 * mma_cta_rows<MT>() + 4 * BN);
}

// dq for one (b, h, tile of 64 MT queries). grid (B * H, ceil(T / (64 MT))), block 128.
// MT: m16 query tiles per warp; BN: keys per streamed K/V tile.
template <int HD, int MT, int BN>
__global__ void __launch_bounds__(MMA_THREADS, 2)
    backward_dq_mma_kernel(__nv_bfloat16* dqkv, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                                    const float* lse, const float* delta, int T, int H, int KV, float scale,
                                    float scale_log2) {
    constexpr int LD = HD + 8, ROWS = mma_cta_rows<MT>(), WR = 16 * MT;
    extern __shared__ int4 mma_smem_dq[];
    __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(mma_smem_dq);  // (ROWS, LD)
    __nv_bfloat16* dOs = Qs + ROWS * LD;                                 // (ROWS, LD)
    __nv_bfloat16* Ks = dOs + ROWS * LD;                                 // 2 stages x (BN, LD)
    __nv_bfloat16* Vs = Ks + 2 * BN * LD;                                // 2 stages x (BN, LD)

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = 2 * (lane % 4);
    const int b = blockIdx.x / H, h = blockIdx.x % H, kvh = h / (H / KV);
    const int q0 = (gridDim.y - 1 - blockIdx.y) * ROWS;
    const int qw = q0 + WR * warp;
    const size_t stride = (size_t)(H + 2 * KV) * HD, o_stride = (size_t)H * HD;
    const __nv_bfloat16* k_src = qkv + (size_t)b * T * stride + (size_t)(H + kvh) * HD;
    const __nv_bfloat16* v_src = qkv + (size_t)b * T * stride + (size_t)(H + KV + kvh) * HD;

    const int n_tiles = ceil_div(min(q0 + ROWS, T), BN);
    mma_load_tile_n<HD, ROWS, MMA_THREADS>(Qs, qkv + (size_t)b * T * stride + (size_t)h * HD, stride, q0, T);
    mma_load_tile_n<HD, ROWS, MMA_THREADS>(dOs, dout + (size_t)b * T * o_stride + (size_t)h * HD, o_stride, q0, T);
    mma_load_tile_n<HD, BN, MMA_THREADS>(Ks, k_src, stride, 0, T);
    mma_load_tile_n<HD, BN, MMA_THREADS>(Vs, v_src, stride, 0, T);
    cp_async_commit();

    float lse2[MT][2], D[MT][2];  // rows g, g+8 of each m tile; finite placeholders past T (never stored)
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int q = qw + 16 * mt + g + 8 * r;
            lse2[mt][r] = q < T ? lse[(size_t)blockIdx.x * T + q] * ATTN_LOG2E : 0.0f;
            D[mt][r] = q < T ? delta[(size_t)blockIdx.x * T + q] : 0.0f;
        }
    }
    float dq[MT][HD / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int nt = 0; nt < HD / 8; nt++) dq[mt][nt][0] = dq[mt][nt][1] = dq[mt][nt][2] = dq[mt][nt][3] = 0.0f;
    }
    const uint32_t q_base = smem_addr(Qs), do_base = smem_addr(dOs);

    for (int j = 0; j < n_tiles; j++) {
        const int stage = j % 2;
        if (j + 1 < n_tiles) {
            mma_load_tile_n<HD, BN, MMA_THREADS>(Ks + (1 - stage) * BN * LD, k_src, stride, (j + 1) * BN, T);
            mma_load_tile_n<HD, BN, MMA_THREADS>(Vs + (1 - stage) * BN * LD, v_src, stride, (j + 1) * BN, T);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();

        const int k0 = j * BN;
        if (k0 <= qw + WR - 1) {
            const uint32_t k_base = smem_addr(Ks + stage * BN * LD), v_base = smem_addr(Vs + stage * BN * LD);
            float s[MT][BN / 8][4], dp[MT][BN / 8][4];
            mma_two_products<HD, MT, BN, LD>(s, dp, q_base, do_base, k_base, v_base, WR * warp, lane);
            // dS in place of dP. Element (mt, nt, e): query qw + 16 mt + g + 8 (e / 2), key k0 + 8 nt + c + e % 2.
            // Diagonal tile. Keys >= T need no test of their own: they are after every valid query.
            const bool need_mask = k0 + BN - 1 > qw;
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
#pragma unroll
                for (int nt = 0; nt < BN / 8; nt++) {
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int r = e / 2;
                        float p = exp2f(fmaf(s[mt][nt][e], scale_log2, -lse2[mt][r]));
                        if (need_mask && k0 + 8 * nt + c + e % 2 > qw + 16 * mt + g + 8 * r) p = 0.0f;
                        dp[mt][nt][e] = p * (dp[mt][nt][e] - D[mt][r]);
                    }
                }
            }
            // dQ += dS K: dS from the accumulators, the K tile as B.
            mma_acc_times_bt<HD, MT, BN, LD>(dq, dp, k_base, lane);
        }
        __syncthreads();
    }

    // The warp's own Q rows are dead now (each warp reads only its WR rows of Qs): they stage the result.
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        const int rw = WR * warp + 16 * mt;
        mma_store_warp_rows<HD>(dqkv + (size_t)b * T * stride + (size_t)h * HD, stride, Qs + rw * LD, dq[mt], scale,
                                scale, q0 + rw, T, lane);
    }
}

// One tile configuration of the backward (D included): dQ kernel with QMT m16 query tiles per warp and QBN keys per
// tile; dK/dV kernel with KW warps: KW 4, the 4-warp kernel with KMT m16 key tiles per warp and KBQ queries per tile;
// KW 8, the 8-warp kernel (128 keys per CTA, KMT unused) with KBQ queries per tile.
template <int HD, int QMT, int QBN, int KMT, int KBQ, int KW = 4, bool KSKEW = true>
static void backward_mma_launch(floatX* dqkv, float* delta, const floatX* dout, const floatX* qkv,
                                      const floatX* out, const float* lse, int B, int T, int H, int KV,
                                      cudaStream_t stream) {
    static_assert(KW == 4 || KW == 8, "dK/dV kernel: 4 or 8 warps");
    static bool dq_smem_set = false, dkdv_smem_set = false;
    const size_t dq_smem = backward_dq_mma_smem_bytes<HD, QMT, QBN>();
    attention_set_smem(backward_dq_mma_kernel<HD, QMT, QBN>, dq_smem, dq_smem_set);
    attention_delta(delta, dout, out, B, T, H, HD, stream);
    const float scale = 1.0f / sqrtf((float)HD), scale_log2 = scale * ATTN_LOG2E;
    // dK/dV first: its CTAs are fewer (B KV per key tile) and longer; both kernels only read what they share.
    if constexpr (KW == 4) {
        const size_t dkdv_smem = backward_dkdv_mma_smem_bytes<HD, KMT, KBQ>();
        attention_set_smem(backward_dkdv_mma_kernel<HD, KMT, KBQ>, dkdv_smem, dkdv_smem_set);
        dim3 dkdv_grid(B * KV, ceil_div(T, mma_cta_rows<KMT>()));
        backward_dkdv_mma_kernel<HD, KMT, KBQ><<<dkdv_grid, MMA_THREADS, dkdv_smem, stream>>>(
            dqkv, dout, qkv, lse, delta, T, H, KV, scale, scale_log2);
    } else {
        const size_t dkdv_smem = backward_dkdv_mma8_smem_bytes<HD, KBQ>();
        attention_set_smem(backward_dkdv_mma8_kernel<HD, KBQ, KSKEW>, dkdv_smem, dkdv_smem_set);
        dim3 dkdv_grid(B * KV, ceil_div(T, DKDV8_KEYS));
        backward_dkdv_mma8_kernel<HD, KBQ, KSKEW><<<dkdv_grid, DKDV8_THREADS, dkdv_smem, stream>>>(
            dqkv, dout, qkv, lse, delta, T, H, KV, scale, scale_log2);
    }
    cudaCheckLaunch();
    dim3 dq_grid(B * H, ceil_div(T, mma_cta_rows<QMT>()));
    backward_dq_mma_kernel<HD, QMT, QBN><<<dq_grid, MMA_THREADS, dq_smem, stream>>>(
        dqkv, dout, qkv, lse, delta, T, H, KV, scale, scale_log2);
    cudaCheckLaunch();
}

// Tile configurations as version entries, per head dim: dQ <MT, BN>, dK/dV <MT, BQ>, dK/dV warps (4 or 8) and the
// 8-warp kernel's skew; other head dims take the scalar path.
template <int QMT64, int QBN64, int KMT64, int KBQ64, int QMT128, int QBN128, int KMT128, int KBQ128, int KW64 = 4,
          int KW128 = 4, bool SKEW = true>
static void backward_tc_config(floatX* dqkv, float* delta, const floatX* dout, const floatX* qkv, const floatX* out,
                               const float* lse, int B, int T, int H, int KV, int hd) {
    attention_check_args("backward_tc_config", B, T, H, KV, hd);
    if (hd == 64) {
        return backward_mma_launch<64, QMT64, QBN64, KMT64, KBQ64, KW64, SKEW>(dqkv, delta, dout, qkv, out, lse, B,
                                                                               T, H, KV, 0);
    }
    if (hd == 128) {
        return backward_mma_launch<128, QMT128, QBN128, KMT128, KBQ128, KW128, SKEW>(dqkv, delta, dout, qkv, out,
                                                                                     lse, B, T, H, KV, 0);
    }
    attention_backward_scalar(dqkv, delta, dout, qkv, out, lse, B, T, H, KV, hd, 0);
}

// ---------------------------------------------------------------------------------------------------------------
// v5's wgmma backward with its variants as template arguments (llmc's kernels keep the chosen ones: BQ 64
// and K / V from shared memory in dK/dV; dQ with BN 128 at hd 64, BN 64 and Q / dO in registers at hd 128).
// BQ: queries per dK/dV item; AREG in dK/dV: the warpgroup's K and V rows in registers as A fragments (S^T, dP^T
// then read only Q, dO from shared memory); BN: keys per dQ tile; AREG in dQ: Q and dO rows in registers.

// S-shaped product with A from shared memory (AREG false) or from the warpgroup's registers (AREG true).
template <int HD, int R, int N, bool AREG>
__device__ __forceinline__ void scores_wgmma(float (&d)[N / 2], uint32_t a_tile,
                                             const uint32_t (&a_frags)[AREG ? HD / 16 : 1][4], uint32_t b_tile,
                                             int wg) {
    if constexpr (AREG) wgmma_scores_rs<HD, N>(d, a_frags, wgmma_desc_kmajor(b_tile));
    else wgmma_scores_ss<HD, R, N>(d, wgmma_desc_kmajor(a_tile + 64 * wg * 128), wgmma_desc_kmajor(b_tile));
}

template <int HD, int BQ>
constexpr size_t backward_dkdv_wgmma_smem_bytes() {
    constexpr int S = WGMMA_DKDV_STAGES;
    return sizeof(__nv_bfloat16) * HD * (2 * WGMMA_ROWS + 2 * S * BQ) + sizeof(float) * 2 * S * BQ + 1024;
}

// dK, dV for one (b, kv head, tile of 128 keys). grid (B * KV, ceil(T / 128)), block 256. BQ: queries per item.
// AREG: the warpgroup's K and V rows stay in registers as A fragments (S^T, dP^T then read only Q, dO from shared
// memory: half the shared-memory traffic of those products), at the cost of HD / 2 registers per thread.
template <int HD, int BQ, bool AREG>
__global__ void __launch_bounds__(WGMMA_THREADS, 1)
    backward_dkdv_wgmma_kernel(__nv_bfloat16* dqkv, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                                          const float* lse, const float* delta, int T, int H, int KV, float scale,
                                          float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int ROWS = WGMMA_ROWS, S = WGMMA_DKDV_STAGES;
    constexpr int KBYTES = ROWS * HD * 2, QBYTES = BQ * HD * 2;
    static_assert(ROWS % BQ == 0, "query tiles must start at the key tile's first key");
    static_assert(BQ == 64 || BQ == 128, "S^T, dP^T are wgmma m64nBQk16 with N = 64 or 128 (wgmma_bf16_ss overloads)");
    extern __shared__ uint8_t wgmma_smem[];
    const uint32_t smem = (smem_addr(wgmma_smem) + 1023u) & ~1023u;
    const uint32_t k_sm = smem;                      // K (128 x HD), swizzled
    const uint32_t v_sm = k_sm + KBYTES;             // V (128 x HD)
    const uint32_t q_sm = v_sm + KBYTES;             // S stages x Q (BQ x HD)
    const uint32_t do_sm = q_sm + S * QBYTES;        // S stages x dO (BQ x HD)
    uint8_t* smem_ptr = wgmma_smem + (smem - smem_addr(wgmma_smem));
    float* lse_s = reinterpret_cast<float*>(smem_ptr + 2 * KBYTES + 2 * S * QBYTES);  // S stages x BQ
    float* D_s = lse_s + S * BQ;                                                      // S stages x BQ

    const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, c = 2 * (lane % 4);
    const int b = blockIdx.x / KV, kvh = blockIdx.x % KV, group = H / KV;
    const int k0 = blockIdx.y * ROWS;  // the first key tiles see the most queries: scheduled first
    const int kwg = k0 + 64 * wg;      // the warpgroup's first key
    const int key0 = kwg + 16 * warp + g;  // this thread's keys: key0 and key0 + 8
    const size_t stride = (size_t)(H + 2 * KV) * HD, o_stride = (size_t)H * HD;

    // Items (query head of the group, query tile from the diagonal); k0 is a multiple of BQ.
    const int n_q = ceil_div(T - k0, BQ), n_items = group * n_q;
    auto issue = [&](int item) {
        const int stage = item % S, h = kvh * group + item / n_q, q0 = k0 + (item % n_q) * BQ;
        wgmma_load_tile<HD, BQ>(q_sm + stage * QBYTES, qkv + (size_t)b * T * stride + (size_t)h * HD, stride, q0, T);
        wgmma_load_tile<HD, BQ>(do_sm + stage * QBYTES, dout + (size_t)b * T * o_stride + (size_t)h * HD, o_stride, q0,
                             T);
        const size_t row = ((size_t)b * H + h) * T;  // (b, h) row of lse and delta
        attention_load_row_stats<BQ>(lse_s + stage * BQ, D_s + stage * BQ, lse, delta, row, q0, T);
    };

    wgmma_load_tile<HD, ROWS>(k_sm, qkv + (size_t)b * T * stride + (size_t)(H + kvh) * HD, stride, k0, T);
    wgmma_load_tile<HD, ROWS>(v_sm, qkv + (size_t)b * T * stride + (size_t)(H + KV + kvh) * HD, stride, k0, T);
    issue(0);
    cp_async_commit();
    if (n_items > 1) issue(1);
    cp_async_commit();

    float dk[HD / 2], dv[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; i++) dk[i] = dv[i] = 0.0f;
    uint32_t ka[AREG ? HD / 16 : 1][4], va[AREG ? HD / 16 : 1][4];  // K, V rows as A fragments (AREG)
    uint32_t dsa[BQ / 16][4];  // dS^T as bf16 A registers, read by dK's wgmma, which runs into the next item

    for (int it = 0; it < n_items; it++) {
        // Groups committed so far: items 0 .. it + 1 (one per iteration, possibly empty). All but the newest: it.
        cp_async_wait<1>();
        fence_proxy_async_shared();
        // Item it visible to all; everyone is done with item it - 2 (its dK wgmma was waited for in item it - 1),
        // whose stage is refilled next.
        __syncthreads();
        if (it + 2 < n_items) issue(it + 2);
        cp_async_commit();
        if constexpr (AREG) {
            if (it == 0) {
                wgmma_load_a_frags<HD, ROWS>(ka, smem_ptr, wg);
                wgmma_load_a_frags<HD, ROWS>(va, smem_ptr + KBYTES, wg);
            }
        }

        const int stage = it % S, q0 = k0 + (it % n_q) * BQ;
        if (q0 + BQ - 1 < kwg) {  // warpgroup-uniform: every query of the tile precedes every key
            wgmma_wait_group<0>();  // the previous item's dK must be done before its stage is refilled (next iteration)
            pin_registers(dsa);
            pin_registers(dk);
            continue;
        }
        const uint32_t q_st = q_sm + stage * QBYTES, do_st = do_sm + stage * QBYTES;
        const float* lse_t = lse_s + stage * BQ;
        const float* D_t = D_s + stage * BQ;

        // S^T = K Q^T and dP^T = V dO^T, one commit group each.
        float s[BQ / 2], dp[BQ / 2];
        wgmma_fence();
        scores_wgmma<HD, ROWS, BQ, AREG>(s, k_sm, ka, q_st, wg);
        scores_wgmma<HD, ROWS, BQ, AREG>(dp, v_sm, va, do_st, wg);

        // P^T. Element i: key key0 + 8 ((i / 2) % 2), query q0 + 8 (i / 4) + c + i % 2. Outstanding: the previous
        // item's dK, S^T, dP^T: all but the newest (dP^T) done.
        wgmma_wait_group<1>();
        pin_registers(s);
        pin_registers(dsa);  // the previous item's dK is done with them
        pin_registers(dk);
        attention_backward_probs_t<BQ>(s, lse_t, ATTN_LOG2E, scale_log2, q0, kwg, key0, c, T);
        uint32_t pa[BQ / 16][4];
        wgmma_accumulate_rs<HD, BQ>(dv, pa, s, wgmma_desc_mnmajor(do_st, BQ));  // dV += P^T dO

        // dS^T (dP^T is done once only the dV group may be outstanding), then dK += dS^T Q.
        wgmma_wait_group<1>();
        pin_registers(dp);
#pragma unroll
        for (int i = 0; i < BQ / 2; i++) dp[i] = s[i] * (dp[i] - D_t[8 * (i / 4) + c + i % 2]);
        wgmma_accumulate_rs<HD, BQ>(dk, dsa, dp, wgmma_desc_mnmajor(q_st, BQ));  // dK += dS^T Q
        wgmma_wait_group<1>();  // dV done; dK runs on into the next item
        pin_registers(pa);
        pin_registers(dv);
    }
    wgmma_wait_group<0>();
    pin_registers(dsa);
    pin_registers(dk);

    // Each warpgroup read only its own 64 rows of K and V: after its last wait they stage its results.
    __nv_bfloat16* dqkv_b = dqkv + (size_t)b * T * stride;
    // staged through named barriers 1 + wg
    wgmma_store_rows<HD, ROWS>(dqkv_b + (size_t)(H + kvh) * HD, stride, smem_ptr, dk, scale, kwg, T, wg, 1);
    wgmma_store_rows<HD, ROWS>(dqkv_b + (size_t)(H + KV + kvh) * HD, stride, smem_ptr + KBYTES, dv, 1.0f, kwg, T, wg,
                               1);
#else
    __trap();  // not sm_90a code: never launched (attention_wgmma_usable)
#endif
}
template <int HD, int BN>
constexpr size_t backward_dq_wgmma_smem_bytes() {
    return sizeof(__nv_bfloat16) * HD * (2 * WGMMA_ROWS + 2 * WGMMA_DQ_STAGES * BN) + 1024;
}

// dQ for one (b, h, tile of 128 queries). grid (B * H, ceil(T / 128)), block 256. BN: keys per K / V tile.
// AREG: the warpgroup's Q and dO rows stay in registers as A fragments (as in the dK/dV kernel).
template <int HD, int BN, bool AREG>
__global__ void __launch_bounds__(WGMMA_THREADS, 1)
    backward_dq_wgmma_kernel(__nv_bfloat16* dqkv, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                                        const float* lse, const float* delta, int T, int H, int KV, float scale,
                                        float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int ROWS = WGMMA_ROWS, S = WGMMA_DQ_STAGES;
    constexpr int QBYTES = ROWS * HD * 2, TBYTES = BN * HD * 2;
    static_assert(ROWS % BN == 0, "key tiles must tile the query tile");
    extern __shared__ uint8_t wgmma_smem[];
    const uint32_t smem = (smem_addr(wgmma_smem) + 1023u) & ~1023u;
    const uint32_t q_sm = smem;                     // Q (128 x HD), swizzled
    const uint32_t do_sm = q_sm + QBYTES;           // dO (128 x HD)
    const uint32_t k_sm = do_sm + QBYTES;           // S stages x K (BN x HD)
    const uint32_t v_sm = k_sm + S * TBYTES;        // S stages x V (BN x HD)
    uint8_t* smem_ptr = wgmma_smem + (smem - smem_addr(wgmma_smem));

    const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, c = 2 * (lane % 4);
    const int b = blockIdx.x / H, h = blockIdx.x % H, kvh = h / (H / KV);
    const int q0 = (gridDim.y - 1 - blockIdx.y) * ROWS;  // the longest (last) query tiles are scheduled first
    const int qwg = q0 + 64 * wg;
    const int row0 = qwg + 16 * warp + g;  // this thread's queries: row0 and row0 + 8
    const size_t stride = (size_t)(H + 2 * KV) * HD, o_stride = (size_t)H * HD;
    const __nv_bfloat16* k_src = qkv + (size_t)b * T * stride + (size_t)(H + kvh) * HD;
    const __nv_bfloat16* v_src = qkv + (size_t)b * T * stride + (size_t)(H + KV + kvh) * HD;

    const int n_tiles = ceil_div(min(q0 + ROWS, T), BN);  // causal: keys up to the CTA's last query
    auto issue = [&](int j) {
        wgmma_load_tile<HD, BN>(k_sm + (j % S) * TBYTES, k_src, stride, j * BN, T);
        wgmma_load_tile<HD, BN>(v_sm + (j % S) * TBYTES, v_src, stride, j * BN, T);
    };
    wgmma_load_tile<HD, ROWS>(q_sm, qkv + (size_t)b * T * stride + (size_t)h * HD, stride, q0, T);
    wgmma_load_tile<HD, ROWS>(do_sm, dout + (size_t)b * T * o_stride + (size_t)h * HD, o_stride, q0, T);
    issue(0);
    cp_async_commit();
    if (n_tiles > 1) issue(1);
    cp_async_commit();

    float lse2[2], D[2];  // rows row0, row0 + 8; finite placeholders past T (never stored)
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int q = row0 + 8 * r;
        lse2[r] = q < T ? lse[(size_t)blockIdx.x * T + q] * ATTN_LOG2E : 0.0f;
        D[r] = q < T ? delta[(size_t)blockIdx.x * T + q] : 0.0f;
    }
    float dq[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; i++) dq[i] = 0.0f;
    uint32_t qa[AREG ? HD / 16 : 1][4], doa[AREG ? HD / 16 : 1][4];  // Q, dO rows as A fragments (AREG)

    for (int j = 0; j < n_tiles; j++) {
        cp_async_wait<1>();
        fence_proxy_async_shared();
        __syncthreads();  // tile j visible to all; everyone is done with tile j - 1, whose stage is refilled next
        if (j + 2 < n_tiles) issue(j + 2);
        cp_async_commit();
        if constexpr (AREG) {
            if (j == 0) {
                wgmma_load_a_frags<HD, ROWS>(qa, smem_ptr, wg);
                wgmma_load_a_frags<HD, ROWS>(doa, smem_ptr + QBYTES, wg);
            }
        }

        const int k0 = j * BN;
        if (k0 > qwg + 63) continue;  // warpgroup-uniform: every key of the tile follows every query
        const uint32_t k_st = k_sm + (j % S) * TBYTES, v_st = v_sm + (j % S) * TBYTES;

        // S = Q K^T and dP = dO V^T, one commit group each.
        float s[BN / 2], dp[BN / 2];
        wgmma_fence();
        scores_wgmma<HD, ROWS, BN, AREG>(s, q_sm, qa, k_st, wg);
        scores_wgmma<HD, ROWS, BN, AREG>(dp, do_sm, doa, v_st, wg);

        // P. Element i: query row0 + 8 ((i / 2) % 2), key k0 + 8 (i / 4) + c + i % 2. Keys >= T need no test of
        // their own: they follow every valid query.
        wgmma_wait_group<1>();
        pin_registers(s);
        const bool need_mask = k0 + BN - 1 > qwg;
#pragma unroll
        for (int i = 0; i < BN / 2; i++) {
            const int r = (i / 2) % 2;
            float p = exp2f(fmaf(s[i], scale_log2, -lse2[r]));
            if (need_mask && k0 + 8 * (i / 4) + c + i % 2 > row0 + 8 * r) p = 0.0f;
            s[i] = p;
        }
        // dS, then dQ += dS K: B = the K tile, MN-major; its k16 slice kk (keys 16 kk ..) starts at row 16 kk.
        wgmma_wait_group<0>();
        pin_registers(dp);
#pragma unroll
        for (int i = 0; i < BN / 2; i++) dp[i] = s[i] * (dp[i] - D[(i / 2) % 2]);
        uint32_t dsa[BN / 16][4];
        wgmma_accumulate_rs<HD, BN>(dq, dsa, dp, wgmma_desc_mnmajor(k_st, BN));
        wgmma_wait_group<0>();
        pin_registers(dsa);
        pin_registers(dq);
    }

    // Each warpgroup read only its own 64 rows of Q: after its last wait they stage its result.
    wgmma_store_rows<HD, ROWS>(dqkv + (size_t)b * T * stride + (size_t)h * HD, stride, smem_ptr, dq, scale, qwg, T,
                               wg, 1);  // staged through named barriers 1 + wg
#else
    __trap();  // not sm_90a code: never launched (attention_wgmma_usable)
#endif
}

template <int HD, int BQ, int BN, bool AREG_KV, bool AREG_Q>
static void backward_wgmma_launch(floatX* dqkv, float* delta, const floatX* dout, const floatX* qkv,
                                          const floatX* out, const float* lse, int B, int T, int H, int KV,
                                          cudaStream_t stream) {
    static bool dkdv_smem_set = false, dq_smem_set = false;
    const size_t dkdv_smem = backward_dkdv_wgmma_smem_bytes<HD, BQ>();
    const size_t dq_smem = backward_dq_wgmma_smem_bytes<HD, BN>();
    attention_set_smem(backward_dkdv_wgmma_kernel<HD, BQ, AREG_KV>, dkdv_smem, dkdv_smem_set);
    attention_set_smem(backward_dq_wgmma_kernel<HD, BN, AREG_Q>, dq_smem, dq_smem_set);
    attention_delta(delta, dout, out, B, T, H, HD, stream);
    const float scale = 1.0f / sqrtf((float)HD), scale_log2 = scale * ATTN_LOG2E;
    dim3 dkdv_grid(B * KV, ceil_div(T, WGMMA_ROWS));
    backward_dkdv_wgmma_kernel<HD, BQ, AREG_KV><<<dkdv_grid, WGMMA_THREADS, dkdv_smem, stream>>>(
        dqkv, dout, qkv, lse, delta, T, H, KV, scale, scale_log2);
    cudaCheckLaunch();
    dim3 dq_grid(B * H, ceil_div(T, WGMMA_ROWS));
    backward_dq_wgmma_kernel<HD, BN, AREG_Q><<<dq_grid, WGMMA_THREADS, dq_smem, stream>>>(
        dqkv, dout, qkv, lse, delta, T, H, KV, scale, scale_log2);
    cudaCheckLaunch();
}

// Hopper (wgmma) configurations as version entries: <BQ, BN> for hd 64 and for hd 128, then AREG (K / V in the dK/dV
// kernel, Q / dO in the dQ kernel) for hd 64 and for hd 128; where the Hopper kernels do not apply,
// attention_backward's choice.
template <int BQ64, int BN64, int BQ128, int BN128, bool AKV64, bool AQ64, bool AKV128, bool AQ128>
static void backward_hopper_config(floatX* dqkv, float* delta, const floatX* dout, const floatX* qkv, const floatX* out,
                                   const float* lse, int B, int T, int H, int KV, int hd) {
    if ((hd == 64 || hd == 128) && attention_aligned16({dqkv, dout, qkv}) && attention_wgmma_usable()) {
        attention_check_args("backward_hopper_config", B, T, H, KV, hd);
        if (hd == 64) {
            return backward_wgmma_launch<64, BQ64, BN64, AKV64, AQ64>(dqkv, delta, dout, qkv, out, lse, B, T,
                                                                              H, KV, 0);
        }
        return backward_wgmma_launch<128, BQ128, BN128, AKV128, AQ128>(dqkv, delta, dout, qkv, out, lse, B, T,
                                                                               H, KV, 0);
    }
    attention_backward(dqkv, delta, dout, qkv, out, lse, nullptr, B, T, H, KV, hd, 0);
}
#endif  // !ENABLE_FP32

#if !defined(ENABLE_FP32)
// v6's scratch: one device buffer, grown on demand, kept for the program's lifetime.
static void* v6_scratch(size_t bytes) {
    static void* buf = nullptr;
    static size_t cap = 0;
    if (bytes > cap) {
        if (buf != nullptr) cudaCheck(cudaFree(buf));
        cudaCheck(cudaMalloc(&buf, bytes));
        cap = bytes;
    }
    return buf;
}
#endif

#if !defined(ENABLE_FP32)
// v7's and v8's scratch: one device buffer, grown on demand, zeroed whenever the version or shape changes (its layout
// depends on both, and only the accumulator and counters are left zeroed by a call); reruns reuse it as left.
static void* v7_scratch(int version, int B, int T, int H, int hd) {
    static void* buf = nullptr;
    static size_t cap = 0;
    static int last[5] = {0, 0, 0, 0, 0};
    const size_t bytes = version == 7 ? attention_backward_v7_scratch_bytes<V7Acc>(B, T, H, hd)
                                      : attention_backward_v8_scratch_bytes(B, T, H, hd);
    if (bytes > cap) {
        if (buf != nullptr) cudaCheck(cudaFree(buf));
        cudaCheck(cudaMalloc(&buf, bytes));
        cap = bytes;
    }
    if (last[0] != B || last[1] != T || last[2] != H || last[3] != hd || last[4] != version) {
        cudaCheck(cudaMemset(buf, 0, bytes));
        last[0] = B, last[1] = T, last[2] = H, last[3] = hd, last[4] = version;
    }
    return buf;
}
#endif

#if !defined(ENABLE_FP32)
// v9: v5's two kernels with the dQ kernel on a second stream (fork / join through events), so each kernel's tail of
// short CTAs overlaps the other's work. Outputs are disjoint, so the result is v5's bit for bit.
template <int HD>
static void backward_two_streams_hd(floatX* dqkv, float* delta, const floatX* dout, const floatX* qkv,
                                    const floatX* out, const float* lse, int B, int T, int H, int KV) {
    static cudaStream_t side = nullptr;
    static cudaEvent_t fork, join;
    if (side == nullptr) {
        cudaCheck(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
        cudaCheck(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
        cudaCheck(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
    }
    static bool dkdv_smem_set = false, dq_smem_set = false;
    const size_t dkdv_smem = backward_dkdv_wgmma_smem_bytes<HD, WGMMA_DKDV_QUERIES>();
    const size_t dq_smem = backward_dq_wgmma_smem_bytes<HD, wgmma_dq_keys(HD)>();
    attention_set_smem(backward_dkdv_wgmma_kernel<HD, WGMMA_DKDV_QUERIES, false>, dkdv_smem, dkdv_smem_set);
    constexpr int BN = wgmma_dq_keys(HD);
    constexpr bool AREG = wgmma_dq_q_in_registers(HD);
    attention_set_smem(backward_dq_wgmma_kernel<HD, BN, AREG>, dq_smem, dq_smem_set);
    const cudaStream_t main_stream = 0;
    attention_delta(delta, dout, out, B, T, H, HD, main_stream);
    cudaCheck(cudaEventRecord(fork, main_stream));
    cudaCheck(cudaStreamWaitEvent(side, fork, 0));
    const float scale = 1.0f / sqrtf((float)HD), scale_log2 = scale * ATTN_LOG2E;
    dim3 dq_grid(B * H, ceil_div(T, WGMMA_ROWS));
    backward_dq_wgmma_kernel<HD, BN, AREG><<<dq_grid, WGMMA_THREADS, dq_smem, side>>>(dqkv, dout, qkv, lse, delta, T,
                                                                                       H, KV, scale, scale_log2);
    cudaCheckLaunch();
    dim3 dkdv_grid(B * KV, ceil_div(T, WGMMA_ROWS));
    backward_dkdv_wgmma_kernel<HD, WGMMA_DKDV_QUERIES, false><<<dkdv_grid, WGMMA_THREADS, dkdv_smem, main_stream>>>(
        dqkv, dout, qkv, lse, delta, T, H, KV, scale, scale_log2);
    cudaCheckLaunch();
    cudaCheck(cudaEventRecord(join, side));
    cudaCheck(cudaStreamWaitEvent(main_stream, join, 0));
}
static void backward_two_streams(floatX* dqkv, float* delta, const floatX* dout, const floatX* qkv, const floatX* out,
                                 const float* lse, int B, int T, int H, int KV, int hd) {
    if ((hd == 64 || hd == 128) && attention_wgmma_usable()) {
        if (hd == 64) {
            backward_two_streams_hd<64>(dqkv, delta, dout, qkv, out, lse, B, T, H, KV);
        } else {
            backward_two_streams_hd<128>(dqkv, delta, dout, qkv, out, lse, B, T, H, KV);
        }
        return;
    }
    attention_backward(dqkv, delta, dout, qkv, out, lse, nullptr, B, T, H, KV, hd, 0);
}
#endif

// RoPE's {cos, sin} table for positions 0 .. T - 1 at head dim hd, built as the trainer builds it (model.h's
// rope_tables, interleaved), kept on the device for the last (T, hd) asked for; cos_t, sin_t: the host tables.
static const float* rope_table_for(int T, int hd, std::vector<float>* cos_t = nullptr,
                                   std::vector<float>* sin_t = nullptr) {
    static float* d_table = nullptr;
    static int last_T = -1, last_hd = -1;
    static std::vector<float> cos_table, sin_table;
    if (T != last_T || hd != last_hd) {
        Llama3Config cfg;
        cfg.dim = 4 * hd;
        cfg.n_heads = 4;
        cfg.n_kv_heads = 4;
        cfg.rope_theta = 500000.0f;
        rope_tables(cfg, T, &cos_table, &sin_table);
        std::vector<float> table = rope_interleave_tables(cos_table, sin_table);
        if (d_table != nullptr) cudaCheck(cudaFree(d_table));
        d_table = device_from_host<float>(table);
        last_T = T, last_hd = hd;
    }
    if (cos_t != nullptr) *cos_t = cos_table;
    if (sin_t != nullptr) *sin_t = sin_table;
    return d_table;
}

static void attention_backward_gpu(int version, floatX* dqkv, float* delta, const floatX* dout, const floatX* qkv,
                                   const floatX* out, const float* lse, int B, int T, int H, int KV, int hd) {
    switch (version) {
        case 1: attention_backward_scalar(dqkv, delta, dout, qkv, out, lse, B, T, H, KV, hd, 0); break;
#if !defined(ENABLE_FP32)
        case 2:  // 16 rows per warp in both kernels
            backward_tc_config<1, 64, 1, 64, 1, 64, 1, 32>(dqkv, delta, dout, qkv, out, lse, B, T, H, KV, hd);
            break;
        case 3:  // per-head-dim tile configurations
            backward_tc_config<2, 64, 1, 64, 2, 32, 1, 64>(dqkv, delta, dout, qkv, out, lse, B, T, H, KV, hd);
            break;
        case 4:  // v3 with the 8-warp dK/dV kernel at hd 128
            backward_tc_config<2, 64, 1, 64, 2, 32, 1, 64, 4, 8>(dqkv, delta, dout, qkv, out, lse, B, T, H, KV, hd);
            break;
        case 5:  // the cp.async kernels with the choices the trainer ran until v10
            backward_hopper_config<64, 128, 64, 64, false, false, false, true>(dqkv, delta, dout, qkv, out, lse, B, T,
                                                                               H, KV, hd);
            break;
        case 6: attention_backward_v6(dqkv, delta, dout, qkv, out, lse, B, T, H, KV, hd,
                                      v6_scratch(attention_backward_v6_scratch_bytes(B, T, H, hd)), 0);
            break;
        case 7: attention_backward_v7(dqkv, delta, dout, qkv, out, lse, B, T, H, KV, hd,
                                      v7_scratch(7, B, T, H, hd), 0);
            break;
        case 8: attention_backward_v8(dqkv, delta, dout, qkv, out, lse, B, T, H, KV, hd,
                                      v7_scratch(8, B, T, H, hd), 0);
            break;
        case 9: backward_two_streams(dqkv, delta, dout, qkv, out, lse, B, T, H, KV, hd); break;
        case 10: attention_backward(dqkv, delta, dout, qkv, out, lse, nullptr, B, T, H, KV, hd, 0); break;
        case 11: attention_backward(dqkv, delta, dout, qkv, out, lse, rope_table_for(T, hd), B, T, H, KV, hd, 0); break;
        case 12:  // v11's reference: v10, then RoPE's backward as its own pass (what the trainer ran before v11)
            attention_backward(dqkv, delta, dout, qkv, out, lse, nullptr, B, T, H, KV, hd, 0);
            rope_backward(dqkv, rope_table_for(T, hd), B, T, H, KV, hd, 0);
            break;
        // Tuning candidates (./attention_backward sweep): not versions of their own.
        case 101:  // hd 64: dQ with 32 keys per tile
            backward_tc_config<2, 32, 1, 64, 2, 32, 1, 64>(dqkv, delta, dout, qkv, out, lse, B, T, H, KV, hd);
            break;
        case 102:  // hd 64: dK/dV with 32 queries per tile; hd 128: dQ with 16 queries per warp, 32 keys per tile
            backward_tc_config<2, 64, 1, 32, 1, 32, 1, 64>(dqkv, delta, dout, qkv, out, lse, B, T, H, KV, hd);
            break;
        case 103:  // 8-warp dK/dV (skewed pairs), 64 queries per tile, both head dims
            backward_tc_config<2, 64, 0, 64, 2, 32, 0, 64, 8, 8>(dqkv, delta, dout, qkv, out, lse, B, T, H, KV, hd);
            break;
        case 104:  // 8-warp dK/dV without the skew of the warp pairs, 64 queries per tile, both head dims
            backward_tc_config<2, 64, 0, 64, 2, 32, 0, 64, 8, 8, false>(dqkv, delta, dout, qkv, out, lse, B, T, H,
                                                                         KV, hd);
            break;
        case 105:  // Hopper, no operand in registers; dQ with 64 keys per tile at hd 64
            backward_hopper_config<64, 64, 64, 64, false, false, false, false>(dqkv, delta, dout, qkv, out, lse, B, T,
                                                                               H, KV, hd);
            break;
        case 106:  // Hopper, no operand in registers
            backward_hopper_config<64, 128, 64, 64, false, false, false, false>(dqkv, delta, dout, qkv, out, lse, B,
                                                                                T, H, KV, hd);
            break;
        case 107:  // Hopper, K / V in registers only (hd 64 dK/dV)
            backward_hopper_config<64, 128, 64, 64, true, false, false, false>(dqkv, delta, dout, qkv, out, lse, B, T,
                                                                               H, KV, hd);
            break;
        case 108:  // Hopper, Q / dO in registers in the dQ kernel, both head dims; K / V at hd 64
            backward_hopper_config<64, 128, 64, 64, true, true, false, true>(dqkv, delta, dout, qkv, out, lse, B, T, H,
                                                                             KV, hd);
            break;
#endif
        default: fprintf(stderr, "unknown version %d\n", version); exit(EXIT_FAILURE);
    }
}

#if defined(ENABLE_FP32)
static const int VERSIONS[] = {1};
#else
static const int VERSIONS[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
#endif

// v6 must not depend on its scratch's contents (the dQ accumulator is never zeroed, the counters are zeroed by v6):
// the validation poisons it before every run.
static void poison_scratch(int version, int B, int T, int H, int hd) {
#if !defined(ENABLE_FP32)
    if (version == 6) {
        const size_t bytes = attention_backward_v6_scratch_bytes(B, T, H, hd);
        poison(v6_scratch(bytes), bytes);
    }
#else
    (void)version, (void)B, (void)T, (void)H, (void)hd;
#endif
}

static void validate_shape(int version, const Shape& sh, uint64_t seed) {
    const int B = sh.B, T = sh.T, H = sh.H, KV = sh.KV, hd = sh.hd;
    const size_t n_qkv = (size_t)B * T * (H + 2 * KV) * hd, n_out = (size_t)B * T * H * hd, n_lse = (size_t)B * H * T;
    printf("v%d B=%d T=%d H=%d KV=%d hd=%d\n", version, B, T, H, KV, hd);
    std::vector<float> qkv = round_to_floatX(random_floats(n_qkv, seed, 1.5f));
    std::vector<float> dout = round_to_floatX(random_floats(n_out, seed + 1000, 1.0f));
    std::vector<float> out(n_out), lse(n_lse);
    cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, T, H, KV, hd);
    out = round_to_floatX(out);  // what the GPU forward would have stored
    std::vector<float> dqkv_ref(n_qkv);
    cpu::attention_backward(dqkv_ref.data(), dout.data(), qkv.data(), out.data(), B, T, H, KV, hd);
    const bool with_rope = version == 11 || version == 12;
    if (with_rope) {  // the gradient with respect to q and k before RoPE
        std::vector<float> cos_t, sin_t;
        rope_table_for(T, hd, &cos_t, &sin_t);
        cpu::rope(dqkv_ref.data(), cos_t, sin_t, B, T, H, KV, hd, true);
    }

    floatX* d_qkv = device_from_host<floatX>(qkv);
    floatX* d_out = device_from_host<floatX>(out);
    floatX* d_dout = device_from_host<floatX>(dout);
    float* d_lse = device_from_host<float>(lse);
    floatX* d_dqkv;
    float* d_delta;
    cudaCheck(cudaMalloc(&d_dqkv, n_qkv * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_delta, n_lse * sizeof(float)));

    poison(d_dqkv, n_qkv * sizeof(floatX));
    poison(d_delta, n_lse * sizeof(float));
    poison_scratch(version, B, T, H, hd);
    attention_backward_gpu(version, d_dqkv, d_delta, d_dout, d_qkv, d_out, d_lse, B, T, H, KV, hd);
    cudaCheck(cudaDeviceSynchronize());
    std::vector<float> dqkv = host_from_device(d_dqkv, n_qkv);
    std::vector<float> dq, dk, dv, dq_ref, dk_ref, dv_ref;
    split_qkv(dqkv, B, T, H, KV, hd, dq, dk, dv);
    split_qkv(dqkv_ref, B, T, H, KV, hd, dq_ref, dk_ref, dv_ref);
    validate("dq", dq, dq_ref);
    validate("dk", dk, dk_ref);
    validate("dv", dv, dv_ref);

    // Determinism: a second run into a freshly poisoned buffer must match the first bit for bit.
    floatX* d_dqkv2;
    cudaCheck(cudaMalloc(&d_dqkv2, n_qkv * sizeof(floatX)));
    poison(d_dqkv2, n_qkv * sizeof(floatX));
    poison_scratch(version, B, T, H, hd);
    attention_backward_gpu(version, d_dqkv2, d_delta, d_dout, d_qkv, d_out, d_lse, B, T, H, KV, hd);
    cudaCheck(cudaDeviceSynchronize());
    validate_bitwise("dqkv rerun", d_dqkv, d_dqkv2, n_qkv);
    if (with_rope) {  // the fused RoPE backward leaves the same bits as the separate pass
        poison(d_dqkv2, n_qkv * sizeof(floatX));
        attention_backward_gpu(version == 11 ? 12 : 11, d_dqkv2, d_delta, d_dout, d_qkv, d_out, d_lse, B, T, H, KV,
                               hd);
        cudaCheck(cudaDeviceSynchronize());
        validate_bitwise("dqkv fused RoPE against the separate pass", d_dqkv, d_dqkv2, n_qkv);
    }
    cudaCheck(cudaFree(d_dqkv2));

    cudaCheck(cudaFree(d_qkv));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_dout));
    cudaCheck(cudaFree(d_lse));
    cudaCheck(cudaFree(d_dqkv));
    cudaCheck(cudaFree(d_delta));
}

static void time_shape(int version, const Shape& sh) {
    const int B = sh.B, T = sh.T, H = sh.H, KV = sh.KV, hd = sh.hd;
    const size_t n_qkv = (size_t)B * T * (H + 2 * KV) * hd, n_out = (size_t)B * T * H * hd, n_lse = (size_t)B * H * T;
    floatX* d_qkv = device_random<floatX>(n_qkv, 1234, 2.0f);  // uniform [-2, 2): about unit variance
    floatX* d_dout = device_random<floatX>(n_out, 5678, 1.0f);
    floatX *d_out, *d_dqkv;
    float *d_lse, *d_delta;
    cudaCheck(cudaMalloc(&d_out, n_out * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_dqkv, n_qkv * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_lse, n_lse * sizeof(float)));
    cudaCheck(cudaMalloc(&d_delta, n_lse * sizeof(float)));
    attention_forward(d_out, d_lse, d_qkv, B, T, H, KV, hd, 0);  // realistic out and lse
    float ms = benchmark_ms(10, [&] {
        attention_backward_gpu(version, d_dqkv, d_delta, d_dout, d_qkv, d_out, d_lse, B, T, H, KV, hd);
    });
    // Convention: backward = 2.5 x the causal forward's 2 B H T^2 hd flops.
    const double flops = 2.5 * 2.0 * B * H * (double)T * T * hd;
    printf("  v%d  B=%d H=%d KV=%d T=%d hd=%d: %8.3f ms  %7.2f TFLOP/s\n", version, B, H, KV, T, hd, ms,
           flops / (ms * 1e-3) / 1e12);
    cudaCheck(cudaFree(d_qkv));
    cudaCheck(cudaFree(d_dout));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_dqkv));
    cudaCheck(cudaFree(d_lse));
    cudaCheck(cudaFree(d_delta));
}

int main(int argc, char** argv) {
    require_gpu(argv[0]);  // clear message and exit 1 without a GPU
    std::vector<int> versions(std::begin(VERSIONS), std::end(VERSIONS));
    if (argc > 1 && strcmp(argv[1], "sweep") == 0) {  // tile configurations: spot validation, then timing
        std::vector<int> cfgs = {101, 102, 103, 104, 105, 106, 107, 108};
        if (argc > 2) cfgs = {atoi(argv[2])};
        for (int cfg : cfgs) {
            uint64_t seed = 7;
            for (const Shape& sh : ATTENTION_SWEEP_SHAPES) validate_shape(cfg, sh, seed++);
            for (const Shape& sh : ATTENTION_TIMING_SHAPES) time_shape(cfg, sh);
        }
        return finish(argv[0]);
    }
    if (argc > 1) versions = {atoi(argv[1])};
    if (!attention_versions_known(versions, std::vector<int>(std::begin(VERSIONS), std::end(VERSIONS)),
                                  PRECISION_NAME)) {
        return 1;
    }

    // `time [shape]`: timing only (for profilers), all timing shapes or the one with that index
    const bool time_only = argc > 2 && strcmp(argv[2], "time") == 0;
    if (time_only) {
        const int n_shapes = (int)(sizeof(ATTENTION_TIMING_SHAPES) / sizeof(ATTENTION_TIMING_SHAPES[0]));
        const int only = argc > 3 ? atoi(argv[3]) : -1;
        if (only >= n_shapes) {
            fprintf(stderr, "shape index %d out of range (0..%d)\n", only, n_shapes - 1);
            return 1;
        }
        for (int version : versions) {
            for (int i = 0; i < n_shapes; i++) {
                if (only < 0 || i == only) time_shape(version, ATTENTION_TIMING_SHAPES[i]);
                if ((only < 0 || i == only) && version == 11) time_shape(12, ATTENTION_TIMING_SHAPES[i]);
            }
        }
        return finish(argv[0]);
    }
    for (int version : versions) {
        printf("attention_backward version %d (%s): validation\n", version, PRECISION_NAME);
#if !defined(ENABLE_FP32)
        if ((version == 5 || version == 6) && !attention_wgmma_usable()) {
            printf("  note: no sm_90 device or no sm_90a code in this build: v%d runs v1's kernels\n", version);
        }
#endif
        // T not a multiple of the tiles (v2-v4: 64 fixed rows, 32 or 64 streamed; v5: 128 fixed rows, 64 or 128
        // streamed), group sizes 1, 4, 8, head dims 16, 64, 128.
        uint64_t seed = 7;
        for (const Shape& sh : attention_validation_shapes()) validate_shape(version, sh, seed++);
        // llmc's Hopper kernels with several work items per dQ CTA (v10, v11), and v6's long chains of key tiles
        if (version == 6 || version == 10 || version == 11) {
            for (const Shape& sh : ATTENTION_PERSISTENT_SHAPES) validate_shape(version, sh, seed++);
        }
    }

    if (argc > 2 && strcmp(argv[2], "check") == 0) return finish(argv[0]);  // validation only (for sanitizers)
    printf("timing (TFLOP/s = 2.5 x 2 B H T^2 hd / time)\n");
    for (int version : versions) {
        for (const Shape& sh : ATTENTION_TIMING_SHAPES) {
            time_shape(version, sh);
            if (version == 11) time_shape(12, sh);  // the pair v11 replaces, in the same round
        }
    }
    return finish(argv[0]);
}
