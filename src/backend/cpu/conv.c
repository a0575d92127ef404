/*
 * conv.c - CPU 2-D convolution on oneDNN 2.6 primitives: forward (with bias), backward data,
 * backward weights (with the bias gradient).
 *
 * The user sees NCHW activations and OIHW weights (GOIHW with groups). oneDNN's fast kernels
 * want blocked layouts, so each pass describes its operands with format_tag_any, lets oneDNN
 * choose (nChw16c activations, OIhw16i16o-like weights), and reorders from/to NCHW around the
 * primitive in workspace buffers. Reorders are cached primitives like the convolutions; they
 * also convert dtypes where the primitive wants another one: weight and bias gradients are
 * computed in f32 for bf16 too (see bf16* below) and rounded once by the reorder back to OIHW
 * bf16 - or not at all when the caller gives f32 gw/gb for 16-bit x and gy (autocast: the
 * gradients of the f32 master weights); f16 runs in f32 and then needs no narrowing either.
 * Ungrouped unpadded 1x1 convolutions are gemms over NCHW and mostly run on plain descriptors,
 * no reorder (plain_1x1, second table). bf16 weight gradients on the blocked path are split
 * over threads by conv.c itself (third table): oneDNN's own threading of that kernel spins and
 * collapses when the machine is loaded.
 *
 * Measured on this machine (AMD Zen 5, AVX512_BF16, 2 threads, oneDNN 2.6.3, one run, min of 8;
 * runs on this shared machine vary by ~10%), N=64, ms for forward + backward data + backward
 * weights including reorders (convolutions + reorders):
 *
 *   layer                        dtype  (a) plain NCHW   (b) any + reorders   (c) NHWC + reorders
 *   3x3 s1 64->64 32x32          f32    128.2            48.1 (42.4+5.7)      51.5 (42.1+ 9.3)
 *                                bf16    88.6            26.7 (21.9+4.8)      27.4 (21.5+ 6.0)
 *                                bf16*   81.5            23.6 (18.9+4.6)      26.5 (20.6+ 5.9)
 *   3x3 s2 64->128 32x32->16x16  f32     42.1            27.9 (23.4+4.4)      29.6 (22.6+ 7.0)
 *                                bf16    27.1            16.3 (12.6+3.7)      17.6 (12.7+ 4.9)
 *                                bf16*   18.9            13.2 (10.1+3.1)      14.3 (10.7+ 3.7)
 *   1x1 s2 64->128 32x32->16x16  f32      9.8             9.1 ( 3.5+5.6)      12.9 ( 5.3+ 7.6)
 *                                bf16     6.0             5.1 ( 1.7+3.4)       6.6 ( 2.2+ 4.4)
 *   1x1 s1 64->64 32x32          f32      9.2            12.9 ( 5.6+7.3)      19.8 (10.1+ 9.7)
 *                                bf16     4.6             7.9 ( 3.3+4.6)       9.1 ( 3.0+ 6.1)
 *   1x1 s1 256->64 16x16         f32      5.4            11.5 ( 6.5+5.0)      13.9 ( 6.5+ 7.3)
 *                                bf16     3.5             6.0 ( 2.8+3.1)       7.0 ( 2.9+ 4.2)
 *   3x3 depthwise 64 32x32       f32     70.4            12.6 ( 5.1+7.5)      15.2 ( 5.1+10.1)
 *                                bf16    76.2             8.0 ( 3.1+4.9)      11.1 ( 4.7+ 6.4)
 *   3x3 groups 2 64->64 32x32    f32    114.5            30.7 (23.1+7.6)      38.7 (28.6+10.1)
 *                                bf16    77.2            16.5 (11.7+4.8)      21.4 (15.0+ 6.3)
 *   3x3 s1 3->64 32x32 (stem)    f32      8.7            10.2 ( 6.4+3.8)      12.9 ( 7.6+ 5.4)
 *                                bf16     5.8             6.1 ( 3.8+2.3)       7.8 ( 4.6+ 3.2)
 *
 * bf16*: weight gradient computed in f32, which the bf16 backward-weights kernels do faster
 * than a bf16 one (3x3 s1: 8.1 vs 9.2 ms, 3x3 s2: 4.6 vs 6.2) and which the reorder back to
 * OIHW rounds to bf16 for free. The stem loses in (b) only by its backward data pass (5.5 vs
 * 2.4 ms f32), which training skips (images need no gradient); forward + backward weights alone
 * take 4.6 vs 6.3 ms (f32) and 2.5 vs 4.2 ms (bf16*) in (b) vs (a).
 *
 * Implementations chosen: plain NCHW runs x64:gemm:jit (im2col + gemm) for every pass and dtype;
 * format any gives jit:avx512_core (f32) and jit_bf16:avx512_core_bf16 (bf16), jit_1x1 /
 * jit_bf16_1x1 for 1x1, jit_dw:avx512_core[_bf16] for depthwise; NHWC gets
 * brgconv:avx512_core[_bf16] forward but the same jit kernels backward, plus costlier reorders.
 * Hence (b), except (a) for most 1x1 (below). bf16 is 2x (3x3) to 1.6x (depthwise) faster
 * than f32. Through ampc_conv2d, one forward + backward (x and w requiring grad) of the 3x3 s1
 * layer takes 43 ms in f32, 22.6 ms in bf16 and 47.7 ms in f16. f16: oneDNN 2.6 has no f16
 * convolution on this CPU, so f16 operands are widened to f32 workspace copies, convolved in
 * f32 and the results rounded once to f16 (as gemm.c does).
 *
 * 1x1 at ResNet sizes (ResNet-50 batch 16, ResNet-18 batch 64), ms per pass with reorders, min
 * over 3 runs of min of 6-15 calls (shared machine, +-15%); bf16 weight gradients into f32,
 * blocked ones not split. Plain wins from 10x10 maps up (the gemm has OH*OW columns per image,
 * the reorders cost as much as the blocked kernel saves); the blocked kernels win on 7x7 and,
 * strided, forward (plain needs an im2col copy first) and f32 weights:
 *
 *   layer (N C->O, map in)    dtype  (a) plain fwd/bwd_d/bwd_w  (b) blocked fwd/bwd_d/bwd_w  chosen
 *   s1 16 64->256 56x56       f32     4.7   3.7   6.8           8.6  10.0   9.5             a a a
 *                             bf16    5.6   3.3   4.0           5.1   5.2   7.8             a a a
 *   s1 16 256->64 56x56       f32     4.7   3.8  10.0          10.6   8.8  11.6             a a a
 *                             bf16    5.4   6.4   6.8           9.7   6.0  16.9             a a a
 *   s1 16 512->128 28x28      f32     7.3   7.2  11.7           9.9  10.1  12.6             a a a
 *                             bf16    2.6   2.9   4.3           3.4   3.6   5.0             a a a
 *   s1 16 1024->256 14x14     f32     8.5   9.8  11.3           9.8   8.7  11.1             a a a
 *                             bf16    4.8   5.4   4.8           5.0   4.9   7.3             a a a
 *   s1 16 2048->512 7x7       f32     5.9   8.0   7.8           5.1   5.4   6.7             b b b
 *                             bf16    3.4   4.8   3.2           2.6   2.8   5.2             b b b*
 *   s1 16 512->2048 7x7       f32     5.7   6.0   7.0           5.2   5.4   5.3             b b b
 *                             bf16    3.4   4.2   4.0           2.7   2.9   3.9             b b b
 *   s2 16 256->512 56x56      f32    18.0  10.7  16.0          15.6  16.2  16.1             b a b
 *                             bf16   17.7  14.8  12.5          14.7  16.0  21.8             b a a
 *   s2 16 1024->2048 14x14    f32    16.3  33.3  25.5          19.7  16.8  18.7             b b b
 *                             bf16    8.2  11.5   9.0           7.6   7.2  15.4             b b b*
 *   s2 64 64->128 32x32       f32     3.8   1.6   4.2           3.0   3.4   3.2             b a b
 *                             bf16    2.6   1.8   2.9           2.1   2.6   3.0             b a a
 *   s2 64 256->512 8x8        f32     1.9   1.9   2.1           1.8   1.8   1.8             b b b
 *                             bf16    1.6   2.3   1.3           1.1   1.1   1.5             b b b*
 *
 * b*: the gemm is faster, but oneDNN's gemm weight gradient takes 48-96 MiB of scratchpad on
 * 7x7 maps (ResNet-50 bf16: workspace peak 96 instead of 41 MiB) for 1-4 ms per layer. In
 * ResNet-50 these choices are worth 2% (fp32, 1366 -> 1339 ms per step) to noise (amp-bf16).
 *
 * bf16 weight gradients, oneDNN's 2-thread primitive (unsplit) vs one 1-thread primitive per
 * thread (split, by output channels where weights outnumber inputs, else by images), ms with
 * reorders, min of 10; idle machine (load 0.7), then loaded by other processes (load 2-3):
 *
 *   layer                      split     idle: unsplit  split    loaded: unsplit    split
 *   3x3 s1 64 512->512 4x4     channels         9.0     8.5              17-730     15
 *   3x3 s2 64 256->512 8x8     channels         5.9     6.0              11-500     12-15
 *   3x3 s1 16 512->512 7x7     channels         6.0     6.1              10-131     15-29
 *   3x3 s1 64 64->64 32x32     images           7.9     7.9
 *   3x3 s2 16 128->128 56x56   images           7.3     7.5
 *   3x3 s1 16 256->256 14x14   images           4.6     4.8
 *
 * (the loaded split figures are from splitting by images only). ResNet-18 amp-bf16 per step:
 * 345-434 ms unsplit vs 331-360 split idle; 1072-3718 vs 796-808 ms loaded; with 3 threads on
 * the 2 cores, 3017 vs 441 ms.
 *
 * Channels-last (d->channels_last: x, y, gx, gy stored NHWC; weights OIHW as above). oneDNN
 * takes NHWC activations (dnnl_nhwc) in its jit, jit_1x1 and brgconv kernels, so the
 * activations are used in place - no reorder around any pass - and only the weights (and
 * their gradients) are reordered to the layout oneDNN picks, as on the NCHW path (plain OIHW
 * weights with NHWC activations get oneDNN's reference kernel). Choices, per pass (cl_* below):
 * - stride-1 1x1 convolutions are one gemm over the N*H*W pixels (gemm_pd): no reorder at all;
 *   bf16 weight gradients on maps above 28x28 and bias gradients stay convolutions;
 * - forward runs oneDNN's jit kernels instead of its first choice, brgconv, for bf16 and for
 *   small f32 maps, strided 1x1 and the 1-channel conv;
 * - f32 backward data on 4x4 maps and f32 backward weights of strided or unpadded spatial
 *   kernels on maps of 24x24 and more reorder the activations after all (faster kernels);
 * - bf16 weight gradients are split over threads as above: by images (the batch is outermost
 *   in NHWC), by output channels where the weights outnumber the inputs (each slice's channels
 *   of gy copied out: 4x4 512->512 15.8 vs 18.4 ms by images);
 * - weight gradients with many output channels on small maps are im2col + one matmul instead
 *   (cl_im2col; the third NHWC table below).
 * Measured with a standalone program calling the backend table (f32; bf16 = bf16 x, w, gy with
 * f32 gw as under autocast), interleaved, min of 7 in each of two runs; the machine was shared
 * (load 1-2), figures vary by 10-20% between runs. ms per pass, (a) the NCHW path with its
 * reorders, (b) NHWC; stems and cnn's conv1 skip backward data (training does):
 *
 *   layer (ResNet-18 N=64, ResNet-50 N=16, cnn N=128; C->O, input map)
 *                                  (a) NCHW path                 (b) NHWC
 *                                   fwd bwd_d bwd_w    sum       fwd bwd_d bwd_w    sum
 *   r18 stem 3->64 32        f32     2.3     -   2.5    4.7      1.1     -   2.3    3.3
 *   r18 stem 3->64 32        bf16    1.3     -   1.5    2.9      0.5     -   0.9    1.4
 *   r18 3x3 64->64 32        f32    15.8  17.5  17.4   50.7     12.0  16.2  16.2   44.5
 *   r18 3x3 64->64 32        bf16    7.3   7.6  10.3   25.2      5.7   6.5   9.1   21.3
 *   r18 3x3s2 64->128 32     f32    12.3  10.3   9.2   31.8      7.4   7.9   9.3   24.6
 *   r18 3x3s2 64->128 32     bf16    4.1   4.1   5.8   14.0      3.5   3.2   4.5   11.2
 *   r18 1x1s2 64->128 32     f32     2.5   1.6   2.8    6.9      1.2   2.1   1.5    4.9
 *   r18 1x1s2 64->128 32     bf16    1.6   1.2   2.3    5.1      0.5   0.7   0.7    1.9
 *   r18 3x3 128->128 16      f32    12.2  12.3  12.4   36.9     10.3  11.2  11.8   33.3
 *   r18 3x3 128->128 16      bf16    5.7   5.9   6.9   18.5      5.1   5.3   6.7   17.1
 *   r18 3x3s2 128->256 16    f32     6.9   8.0   7.4   22.4      5.8   6.0   7.3   19.1
 *   r18 3x3s2 128->256 16    bf16    3.6   4.3   5.7   13.5      3.2   3.8   5.2   12.2
 *   r18 1x1s2 128->256 16    f32     1.3   1.5   1.4    4.3      0.8   1.1   1.0    3.0
 *   r18 1x1s2 128->256 16    bf16    0.9   0.9   1.0    2.8      0.4   0.5   0.6    1.5
 *   r18 3x3 256->256 8       f32    12.8  12.9  13.3   39.1     10.2  11.8  12.4   34.4
 *   r18 3x3 256->256 8       bf16    7.0   8.0   8.8   23.8      6.1   7.0   8.2   21.3
 *   r18 3x3s2 256->512 8     f32    10.2  13.2  16.6   40.0      8.8  10.1  15.5   34.3
 *   r18 3x3s2 256->512 8     bf16    5.4   7.5  13.0   25.8      4.7   7.8  13.5   26.0
 *   r18 1x1s2 256->512 8     f32     1.8   1.4   2.0    5.2      1.2   0.9   1.5    3.5
 *   r18 1x1s2 256->512 8     bf16    1.1   1.0   1.6    3.7      0.6   0.8   1.1    2.6
 *   r18 3x3 512->512 4       f32    16.4  18.7  28.8   63.9     16.2  18.0  15.7   49.8
 *   r18 3x3 512->512 4       bf16    5.3   7.0  10.3   22.6      4.7   5.8  10.9   21.4
 *   r50 stem 7x7s2 3->64 224 f32    12.3     -  13.9   26.3      8.6     -  14.4   23.0
 *   r50 stem 7x7s2 3->64 224 bf16   10.8     -  10.7   21.5      5.9     -   7.8   13.7
 *   r50 1x1 64->64 56        f32     2.0   1.1   3.5    6.7      1.9   1.8   2.4    6.1
 *   r50 1x1 64->64 56        bf16    1.9   1.1   1.3    4.3      0.7   0.6   1.0    2.2
 *   r50 3x3 64->64 56        f32    11.9  11.2  12.4   35.5      8.5  10.2  12.1   30.8
 *   r50 3x3 64->64 56        bf16    5.6   5.9   6.8   18.3      4.4   4.7   7.1   16.2
 *   r50 1x1 64->256 56       f32     4.9   4.0   6.8   15.7      5.0   5.9   8.0   18.9
 *   r50 1x1 64->256 56       bf16    5.5   3.5   4.3   13.3      2.4   2.8   4.2    9.4
 *   r50 1x1 256->64 56       f32     4.9   4.0   9.8   18.7      6.4   5.4   6.1   17.9
 *   r50 1x1 256->64 56       bf16    4.8   4.0   4.4   13.2      3.4   2.6   4.7   10.7
 *   r50 1x1s2 256->512 56    f32    13.5   9.3  15.0   37.8      8.8  10.5  11.0   30.2
 *   r50 1x1s2 256->512 56    bf16    7.9   7.7   8.5   24.1      4.1   5.2   7.4   16.6
 *   r50 3x3s2 128->128 56    f32    15.8  15.2  14.6   45.6      9.7  11.1  15.7   36.5
 *   r50 3x3s2 128->128 56    bf16    6.1   6.7   9.8   22.6      5.7   5.2   8.9   19.8
 *   r50 1x1 512->128 28      f32     4.1   4.0   7.5   15.6      4.7   4.4   7.6   16.8
 *   r50 1x1 512->128 28      bf16    2.7   3.0   4.0    9.7      2.5   2.2   3.5    8.3
 *   r50 3x3 128->128 28      f32    11.2  10.8  11.7   33.7      8.6   9.8  10.2   28.5
 *   r50 3x3 128->128 28      bf16    4.9   5.1   6.0   15.9      4.2   4.7   6.1   14.9
 *   r50 1x1 1024->256 14     f32     4.3   5.1   5.8   15.3      4.1   4.0   5.1   13.2
 *   r50 1x1 1024->256 14     bf16    2.6   2.9   2.7    8.2      2.3   2.0   2.7    6.9
 *   r50 3x3 256->256 14      f32    10.1   9.9  11.1   31.1      8.1   9.1   9.7   26.9
 *   r50 3x3 256->256 14      bf16    4.6   5.0   6.4   16.0      4.3   4.5   6.0   14.7
 *   r50 1x1 2048->512 7      f32     5.0   5.7   6.5   17.1      4.1   4.6   4.9   13.6
 *   r50 1x1 2048->512 7      bf16    2.9   2.8   8.0   13.7      2.1   2.3   2.8    7.2
 *   r50 3x3 512->512 7       f32    10.6  11.1  19.1   40.9      9.9  10.2  13.8   33.9
 *   r50 3x3 512->512 7       bf16    4.6   6.3  10.2   21.1      4.3   5.9   9.3   19.5
 *   r50 1x1 512->2048 7      f32     7.6   7.4   9.2   24.1      5.3   5.7   6.3   17.4
 *   r50 1x1 512->2048 7      bf16    4.9   5.3   7.2   17.4      4.2   4.4   5.0   13.6
 *   r50 1x1s2 1024->2048 14  f32    18.5  19.1  22.3   59.9     17.6  19.6  23.9   61.0
 *   r50 1x1s2 1024->2048 14  bf16   10.0   9.9  19.6   39.5      8.1   8.8  19.7   36.6
 *   cnn 1->32 28             f32     1.6     -   3.5    5.1      0.7     -   3.8    4.5
 *   cnn 1->32 28             bf16    1.2     -   1.9    3.1      0.4     -   0.6    1.0
 *   cnn 32->64 26            f32    15.8  16.7  17.7   50.2     12.7  14.4  18.6   45.6
 *   cnn 32->64 26            bf16    8.9   9.2  10.6   28.7      6.0   7.3   8.7   21.9
 *
 * Sum over these layers (each once), (a) -> (b): ResNet-18 f32 306 -> 255 ms, bf16 158 -> 138;
 * ResNet-50 f32 424 -> 375, bf16 259 -> 210; cnn f32 55 -> 50, bf16 32 -> 23. Still slower per
 * layer: f32 1x1 64->256 at 56x56 (15.7 vs 18.9 ms: the gemm's backward data 5.9 vs 4.0, and
 * oneDNN's NHWC 1x1 kernels are slower still), and within the noise (<8%) f32 1x1 512->128 28,
 * f32 1x1 s2 1024->2048 14 and bf16 3x3 s2 256->512 8. *
 * Channels-last im2col + matmul (i2c_run; cl_im2col): cols (N*OH*OW, KH*KW*C) is a copy of
 * runs of C values, and each pass one oneDNN matmul (brgemm) with a transposed operand where
 * needed. Only backward weights adopts it, with many output channels on output maps of at
 * most 14x14: oneDNN's direct backward-weights kernels run at 50-60% of peak there (strided
 * worst: 3x3 s2 256->512 8x8 bf16 at ~30%), while the matmul reaches ~800 GFLOP/s bf16 and
 * building cols is cheap (O flops per byte of cols). Forward and backward data lose on every
 * layer below (the direct kernels run at 85-95% of peak; cols, or gx_cols in f32 and the col2im
 * gather, cost more than the matmul could save), so they are implemented but never chosen.
 * Same standalone program, N as above, ms per pass, min of 5 interleaved (a: the NHWC path
 * above, b: im2col forced), then backward weights again, min of 8 interleaved, a vs the rule's
 * choice; shared machine (load 1-2), 10-20% between runs:
 *
 *   layer                          (a) NHWC path       (b) im2col          bwd_w a / rule
 *                                  fwd bwd_d bwd_w     fwd bwd_d bwd_w
 *   r18 3x3 64->64 32        f32    11.2  12.8  13.4    17.2  29.4  17.1    13.1  13.7
 *   r18 3x3 64->64 32        bf16    5.3   5.4   7.0    10.3  23.7  13.1     8.4   8.3
 *   r18 3x3s2 64->128 32     f32     6.4   6.7   7.8     7.2  10.3   7.4     9.0   8.8
 *   r18 3x3s2 64->128 32     bf16    3.5   3.2   5.2     4.8  10.6   5.4     5.0   5.2
 *   r18 1x1s2 64->128 32     f32     1.2   1.6   1.1     1.0   2.2   1.5     1.5   1.5
 *   r18 1x1s2 64->128 32     bf16    0.5   0.6   0.6     0.5   2.6   0.9     0.6   0.6
 *   r18 3x3 128->128 16      f32     9.9  10.4  11.5    14.5  19.0  15.1    12.8  13.0
 *   r18 3x3 128->128 16      bf16    4.8   5.0   6.3     7.0  12.2   7.6     7.1   7.1
 *   r18 3x3s2 128->256 16    f32     5.4   5.8   6.9     6.4   7.4   6.6     8.3   8.3
 *   r18 3x3s2 128->256 16    bf16    3.0   3.5   4.8     3.3   5.1   3.7     6.1   4.2  im2col
 *   r18 1x1s2 128->256 16    f32     0.7   1.0   0.8     0.7   1.3   0.9     0.8   0.9
 *   r18 1x1s2 128->256 16    bf16    0.4   0.4   0.5     0.5   1.3   0.5     0.5   0.5
 *   r18 3x3 256->256 8       f32     9.4  10.4  10.7    12.5  15.5  14.9    11.9  11.6
 *   r18 3x3 256->256 8       bf16    5.1   5.6   6.8     6.3   8.6   7.5     7.6   7.5
 *   r18 3x3s2 256->512 8     f32     5.3   6.6   8.6     6.1   6.4   6.2    10.2   7.1  im2col
 *   r18 3x3s2 256->512 8     bf16    2.6   4.1   7.1     3.0   4.0   3.3     8.9   4.1  im2col
 *   r18 1x1s2 256->512 8     f32     0.7   0.7   0.7     0.7   1.1   0.8     0.8   0.8
 *   r18 1x1s2 256->512 8     bf16    0.4   0.4   0.6     0.4   0.8   0.5     0.7   0.5  im2col
 *   r18 3x3 512->512 4       f32    10.5   9.6  12.5    12.3  12.8  12.5    15.1  15.0
 *   r18 3x3 512->512 4       bf16    5.1   5.7  10.8     7.2   8.0   8.5    10.0   7.8  im2col
 *   r18 stem 3->64 32        f32     1.1     -   2.4     2.4     -   3.5     0.9   0.9
 *   r18 stem 3->64 32        bf16    0.5     -   0.9     1.4     -   2.7     0.7   0.7
 *   r50 3x3 64->64 56        f32     8.1   9.2  10.4    13.9  22.2  14.0    10.4  10.1
 *   r50 3x3 64->64 56        bf16    4.1   4.2   5.4     8.9  22.7  10.8     5.1   5.2
 *   r50 3x3s2 128->128 56    f32     8.9   9.1  12.9    11.6  15.2  12.2    11.8  12.2
 *   r50 3x3s2 128->128 56    bf16    4.9   4.6   6.7     6.2  11.5   6.9     7.8   7.8
 *   r50 3x3 128->128 28      f32     7.9   8.5   9.3    11.6  14.5  11.5    10.5  10.3
 *   r50 3x3 128->128 28      bf16    3.9   4.1   4.9     5.8  10.3   7.2     5.5   5.4
 *   r50 3x3s2 256->256 28    f32     8.4   9.0  14.1    10.6  11.8  11.0    17.3  12.3  im2col
 *   r50 3x3s2 256->256 28    bf16    4.7   5.5   8.1     5.3   9.5   6.6     7.5   6.1  im2col
 *   r50 3x3 256->256 14      f32     7.5   8.2   8.3     9.8  10.9  10.5    10.1   9.7
 *   r50 3x3 256->256 14      bf16    4.1   4.3   4.9     4.9   7.1   6.0     5.6   5.6
 *   r50 3x3s2 512->512 14    f32    11.4  10.0  16.5    10.5  11.3  10.7    21.6  11.5  im2col
 *   r50 3x3s2 512->512 14    bf16    4.8   6.6  13.4     5.3   7.0   6.5    10.4   5.9  im2col
 *   r50 3x3 512->512 7       f32     8.7   8.8   9.5    10.0  10.1  10.1    12.9  13.4
 *   r50 3x3 512->512 7       bf16    3.8   4.9   6.1     4.8   5.7   5.3     8.0   6.9  im2col
 *   r50 1x1s2 256->512 56    f32     8.1   9.4   9.8     8.7  11.7   9.6     9.4  16.9
 *   r50 1x1s2 256->512 56    bf16    7.2   7.7   9.8     7.7  16.1  10.2     5.4   5.5
 *   r50 1x1s2 512->1024 28   f32    14.5  14.9  16.5    14.8  17.5  17.3     8.9   9.0
 *   r50 1x1s2 512->1024 28   bf16    3.7   3.9   6.1     3.9   6.4   4.4     6.2   4.4  im2col
 *   r50 1x1s2 1024->2048 14  f32     8.7   9.2  10.8     7.9   9.3   8.5    11.9   9.4  im2col
 *   r50 1x1s2 1024->2048 14  bf16    3.9   4.4  16.4     4.4   6.3   5.2    19.0   5.5  im2col
 *   cnn 1->32 28             f32     0.7     -   0.9     2.8     -   3.7     0.6   0.6
 *   cnn 1->32 28             bf16    0.2     -   0.3     1.4     -   1.9     0.3   0.3
 *   cnn 32->64 26            f32     7.6   8.6   9.8    14.4  30.7  13.6    10.7  11.2
 *   cnn 32->64 26            bf16    3.6   4.5   5.3     6.1  24.0   9.7     5.5   5.8
 *
 * cols is capped at 32 MiB (ampc__cpu_conv_im2col_cap): larger batches are split into equal
 * chunks of images whose matmuls accumulate into the f32 dW. No chosen layer above needs a
 * split (the largest, 3x3 s2 256->256 28x28 f32, takes 28.9 MB); splitting costs a smaller
 * reduction per matmul and one more pass over dW per chunk: 3x3 512->512 4x4 bf16 (9.4 MB of
 * cols) takes 7.7 ms whole, 9.6 ms in 3 chunks (4 MiB cap), 13.5 ms in 10 (1 MiB).
 */
#include "backend/backend.h"
#include "backend/cpu/cpu.h"
#include "backend/cpu/dnnl_cache.h"

#include <omp.h>
#include <string.h>

// ---------------------------------------------------------------------------------------------
// Keys and descriptors

/* Everything that makes two calls need different primitives; zeroed before filling so it can
   be compared bytewise. The pass is the cache family (AMPC_DNNL_CONV_FWD, ...). */
typedef struct {
    dnnl_data_type_t dt;   /* src/weights/dst: f32 or bf16 (f16 runs as f32) */
    int32_t has_bias, blocked, nthr;
    int32_t grad_f32;      /* backward weights of bf16: the user's gw/gb are f32 (not rounded) */
    int32_t slot;          /* split backward weights: 1.. the one-thread primitive of a slice, -1 its reorders */
    int32_t cl;            /* activations (src, dst and their gradients) NHWC, never reordered */
    int32_t gemm;          /* channels-last 1x1: a matmul primitive instead (see gemm_pd) */
    int32_t no_brg;        /* channels-last forward: skip oneDNN's brgconv implementations */
    int32_t cl_reorder;    /* channels-last, but the activations reordered to oneDNN's choice */
    int32_t im2col;        /* channels-last: im2col + a matmul primitive (see i2c_pd); N = images per chunk */
    int32_t accum;         /* im2col backward weights: the matmul adds to its dst (later chunks) */
    int64_t N, C, H, W, O, KH, KW, OH, OW;
    int64_t stride[2], dil[2], pad_l[2], pad_r[2], groups;   /* oneDNN's: dilation d-1 */
} conv_key;

/* A reorder is identified by the convolution it serves and the argument it converts. */
typedef struct {
    conv_key conv;
    int32_t family, arg;
} reorder_key;

typedef enum { ROLE_SRC, ROLE_WEI, ROLE_DST, ROLE_BIAS } arg_role;

/* The arguments of each pass, in the order of the handles given to conv_run. Gradients of
   weights and bias are produced in f32 (oneDNN's faster bf16 backward-weights variant). */
typedef struct {
    int arg;
    arg_role role;
    bool output, f32;
} arg_spec;

static const arg_spec FWD_ARGS[] = {{DNNL_ARG_SRC, ROLE_SRC, false, false}, {DNNL_ARG_WEIGHTS, ROLE_WEI, false, false},
                                    {DNNL_ARG_DST, ROLE_DST, true, false}, {DNNL_ARG_BIAS, ROLE_BIAS, false, false}};
static const arg_spec BWD_DATA_ARGS[] = {{DNNL_ARG_DIFF_DST, ROLE_DST, false, false},
                                         {DNNL_ARG_WEIGHTS, ROLE_WEI, false, false},
                                         {DNNL_ARG_DIFF_SRC, ROLE_SRC, true, false}};
static const arg_spec BWD_WEIGHTS_ARGS[] = {{DNNL_ARG_SRC, ROLE_SRC, false, false}, {DNNL_ARG_DIFF_DST, ROLE_DST, false, false},
                                            {DNNL_ARG_DIFF_WEIGHTS, ROLE_WEI, true, true},
                                            {DNNL_ARG_DIFF_BIAS, ROLE_BIAS, true, true}};

static const arg_spec *family_args(int family, int *n, const conv_key *k) {
    switch (family) {
    case AMPC_DNNL_CONV_FWD: *n = k->has_bias ? 4 : 3; return FWD_ARGS;
    case AMPC_DNNL_CONV_BWD_DATA: *n = 3; return BWD_DATA_ARGS;
    default: *n = k->has_bias ? 4 : 3; return BWD_WEIGHTS_ARGS;
    }
}

/* Activations: NHWC as the user stores them when channels-last (the kernels take it as is),
   else plain NCHW or "any". */
static dnnl_format_tag_t act_tag(const conv_key *k, bool any) {
    if (k->cl && k->cl_reorder) return any ? dnnl_format_tag_any : dnnl_nhwc;
    return k->cl ? dnnl_nhwc : any ? dnnl_format_tag_any : dnnl_nchw;
}

/* Descriptor of an operand with the given role: plain NCHW / OIHW / GOIHW / (O) when tag is
   not any, else "any" (oneDNN chooses; the bias stays plain). */
static dnnl_status_t role_md(dnnl_memory_desc_t *md, const conv_key *k, arg_role role, dnnl_data_type_t dt, bool any) {
    dnnl_dims_t dims = {0};
    switch (role) {
    case ROLE_SRC:
        dims[0] = k->N, dims[1] = k->C, dims[2] = k->H, dims[3] = k->W;
        return dnnl_memory_desc_init_by_tag(md, 4, dims, dt, act_tag(k, any));
    case ROLE_DST:
        dims[0] = k->N, dims[1] = k->O, dims[2] = k->OH, dims[3] = k->OW;
        return dnnl_memory_desc_init_by_tag(md, 4, dims, dt, act_tag(k, any));
    case ROLE_WEI:
        if (k->groups > 1) {
            dims[0] = k->groups, dims[1] = k->O / k->groups, dims[2] = k->C / k->groups, dims[3] = k->KH, dims[4] = k->KW;
            return dnnl_memory_desc_init_by_tag(md, 5, dims, dt, any ? dnnl_format_tag_any : dnnl_goihw);
        }
        dims[0] = k->O, dims[1] = k->C, dims[2] = k->KH, dims[3] = k->KW;
        return dnnl_memory_desc_init_by_tag(md, 4, dims, dt, any ? dnnl_format_tag_any : dnnl_oihw);
    default:
        dims[0] = k->O;
        return dnnl_memory_desc_init_by_tag(md, 1, dims, dt, dnnl_a);
    }
}

/* The user's side of an argument: plain layout in the kernel's dtype (f32 weight and bias
   gradients when the caller gave f32 ones). */
static dnnl_status_t user_md(dnnl_memory_desc_t *md, const conv_key *k, const arg_spec *a) {
    return role_md(md, k, a->role, a->f32 && k->grad_f32 ? dnnl_f32 : k->dt, false);
}

// ---------------------------------------------------------------------------------------------
// Primitive builders

/* The key's geometry as the whole dnnl_dims_t arrays the C API reads. */
typedef struct {
    dnnl_dims_t stride, dil, pad_l, pad_r;
} conv_geom;

static conv_geom geom(const conv_key *k) {
    conv_geom g;
    memset(&g, 0, sizeof g);
    for (int i = 0; i < 2; i++) g.stride[i] = k->stride[i], g.dil[i] = k->dil[i], g.pad_l[i] = k->pad_l[i], g.pad_r[i] = k->pad_r[i];
    return g;
}

/* The primitive descriptor of op: oneDNN's first implementation, or with no_brg the first that
   is neither brgconv nor the reference one (and the first if there is none such). */
static dnnl_status_t create_pd(dnnl_primitive_desc_t *pd, const_dnnl_op_desc_t op, const_dnnl_primitive_desc_t hint,
                               bool no_brg) {
    if (!no_brg) return dnnl_primitive_desc_create(pd, op, ampc__dnnl_attr(), ampc__dnnl_engine(), hint);
    dnnl_primitive_desc_iterator_t it;
    dnnl_status_t st = dnnl_primitive_desc_iterator_create(&it, op, ampc__dnnl_attr(), ampc__dnnl_engine(), hint);
    if (st != dnnl_success) return st;
    dnnl_primitive_desc_t first = NULL;
    *pd = NULL;
    do {
        dnnl_primitive_desc_t p = dnnl_primitive_desc_iterator_fetch(it);
        const char *name = NULL;
        if (!p) break;
        if (dnnl_primitive_desc_query(p, dnnl_query_impl_info_str, 0, &name) == dnnl_success && name &&
            strncmp(name, "brg", 3) && strncmp(name, "ref", 3)) {
            *pd = p;
            break;
        }
        if (first) dnnl_primitive_desc_destroy(p);
        else first = p;
    } while (dnnl_primitive_desc_iterator_next(it) == dnnl_success);
    dnnl_primitive_desc_iterator_destroy(it);
    if (*pd) {
        if (first) dnnl_primitive_desc_destroy(first);
        return dnnl_success;
    }
    *pd = first;
    return first ? dnnl_success : dnnl_unimplemented;
}

/* Forward descriptor (also the hint the backward passes need). */
static int fwd_pd(dnnl_primitive_desc_t *pd, const conv_key *k, bool with_bias) {
    int rc = AMPC_OK;
    bool any = k->blocked;
    dnnl_memory_desc_t src, wei, dst, bias;
    conv_geom g = geom(k);
    AMPC_DNNL_TRY(role_md(&src, k, ROLE_SRC, k->dt, any), "conv src descriptor");
    AMPC_DNNL_TRY(role_md(&wei, k, ROLE_WEI, k->dt, any), "conv weights descriptor");
    AMPC_DNNL_TRY(role_md(&dst, k, ROLE_DST, k->dt, any), "conv dst descriptor");
    AMPC_DNNL_TRY(role_md(&bias, k, ROLE_BIAS, k->dt, false), "conv bias descriptor");
    dnnl_convolution_desc_t op;
    AMPC_DNNL_TRY(dnnl_dilated_convolution_forward_desc_init(&op, dnnl_forward_training, dnnl_convolution_direct, &src, &wei,
                                                             with_bias ? &bias : NULL, &dst, g.stride, g.dil, g.pad_l, g.pad_r),
                  "convolution_forward_desc_init");
    AMPC_DNNL_TRY(create_pd(pd, &op, NULL, k->no_brg), "convolution forward primitive_desc_create");
    return AMPC_OK;
fail:
    return rc;
}

/* Declares the entry's arguments with the descriptors the primitive chose. */
static int add_args(ampc_dnnl_entry *e, int family, const conv_key *k) {
    int n, rc;
    const arg_spec *args = family_args(family, &n, k);
    for (int i = 0; i < n; i++) {
        const dnnl_memory_desc_t *md = dnnl_primitive_desc_query_md(e->pd, dnnl_query_exec_arg_md, args[i].arg);
        if (!md) return ampc__err(AMPC_ERR_BACKEND, "oneDNN convolution: no descriptor for argument %d", args[i].arg);
        if ((rc = ampc__dnnl_add_arg(e, args[i].arg, md)) < 0) return rc;
    }
    return AMPC_OK;
}

static int build_fwd(ampc_dnnl_entry *e, const void *key) {
    const conv_key *k = key;
    int rc = fwd_pd(&e->pd, k, k->has_bias);
    return rc < 0 ? rc : add_args(e, AMPC_DNNL_CONV_FWD, k);
}

static int build_bwd_data(ampc_dnnl_entry *e, const void *key) {
    const conv_key *k = key;
    int rc = AMPC_OK;
    dnnl_primitive_desc_t hint = NULL;
    dnnl_memory_desc_t src, wei, dst;
    conv_geom g = geom(k);
    if ((rc = fwd_pd(&hint, k, false)) < 0) return rc;
    AMPC_DNNL_TRY(role_md(&src, k, ROLE_SRC, k->dt, k->blocked), "conv diff_src descriptor");
    AMPC_DNNL_TRY(role_md(&wei, k, ROLE_WEI, k->dt, k->blocked), "conv weights descriptor");
    AMPC_DNNL_TRY(role_md(&dst, k, ROLE_DST, k->dt, k->blocked), "conv diff_dst descriptor");
    dnnl_convolution_desc_t op;
    AMPC_DNNL_TRY(dnnl_dilated_convolution_backward_data_desc_init(&op, dnnl_convolution_direct, &src, &wei, &dst, g.stride,
                                                                   g.dil, g.pad_l, g.pad_r),
                  "convolution_backward_data_desc_init");
    AMPC_DNNL_TRY(dnnl_primitive_desc_create(&e->pd, &op, ampc__dnnl_attr(), ampc__dnnl_engine(), hint),
                  "convolution backward data primitive_desc_create");
    rc = add_args(e, AMPC_DNNL_CONV_BWD_DATA, k);
fail:
    dnnl_primitive_desc_destroy(hint);
    return rc;
}

static int build_bwd_weights(ampc_dnnl_entry *e, const void *key) {
    const conv_key *k = key;
    int rc = AMPC_OK;
    dnnl_primitive_desc_t hint = NULL;
    dnnl_memory_desc_t src, dwei, dst, dbias;
    conv_geom g = geom(k);
    if ((rc = fwd_pd(&hint, k, k->has_bias)) < 0) return rc;
    AMPC_DNNL_TRY(role_md(&src, k, ROLE_SRC, k->dt, k->blocked), "conv src descriptor");
    AMPC_DNNL_TRY(role_md(&dwei, k, ROLE_WEI, dnnl_f32, k->blocked), "conv diff_weights descriptor");
    AMPC_DNNL_TRY(role_md(&dst, k, ROLE_DST, k->dt, k->blocked), "conv diff_dst descriptor");
    AMPC_DNNL_TRY(role_md(&dbias, k, ROLE_BIAS, dnnl_f32, false), "conv diff_bias descriptor");
    dnnl_convolution_desc_t op;
    AMPC_DNNL_TRY(dnnl_dilated_convolution_backward_weights_desc_init(&op, dnnl_convolution_direct, &src, &dwei,
                                                                      k->has_bias ? &dbias : NULL, &dst, g.stride, g.dil,
                                                                      g.pad_l, g.pad_r),
                  "convolution_backward_weights_desc_init");
    AMPC_DNNL_TRY(dnnl_primitive_desc_create(&e->pd, &op, ampc__dnnl_attr(), ampc__dnnl_engine(), hint),
                  "convolution backward weights primitive_desc_create");
    rc = add_args(e, AMPC_DNNL_CONV_BWD_WEIGHTS, k);
fail:
    dnnl_primitive_desc_destroy(hint);
    return rc;
}

/* The reorder's two descriptors come from the convolution entry; the key (conv key + argument)
   identifies them but cannot hold them, so the caller parks them here (lock held). */
static const dnnl_memory_desc_t *reorder_from, *reorder_to;

static int build_reorder(ampc_dnnl_entry *e, const void *key) {
    (void)key;
    int rc = AMPC_OK;
    AMPC_DNNL_TRY(dnnl_reorder_primitive_desc_create(&e->pd, reorder_from, ampc__dnnl_engine(), reorder_to,
                                                     ampc__dnnl_engine(), ampc__dnnl_attr()),
                  "reorder primitive_desc_create");
    if ((rc = ampc__dnnl_add_arg(e, DNNL_ARG_FROM, reorder_from)) < 0) return rc;
    return ampc__dnnl_add_arg(e, DNNL_ARG_TO, reorder_to);
fail:
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Channels-last 1x1 convolutions as one gemm
//
// An ungrouped, unpadded, stride-1 1x1 convolution of NHWC activations is one matrix product
// over the M = N*H*W pixels: x is (M, C) row-major, y (M, O), and the OIHW weights are (O, C)
// row-major, so every operand is used in place by a matmul primitive (transposes are strides):
//   forward          y  (M, O) = x (M, C)  @ w^T (C, O)   (+ bias)
//   backward data    gx (M, C) = gy (M, O) @ w   (O, C)
//   backward weights gw (O, C) = gy^T (O, M) @ x (M, C)  (into the f32 or 16-bit gw directly)
// The bias gradient is a column sum, which a matmul cannot add: with a bias, backward weights
// stays a convolution.

/* (rows, cols), stored row-major or (trans) as its row-major transpose. */
static dnnl_status_t mat_md(dnnl_memory_desc_t *md, dnnl_data_type_t dt, int64_t rows, int64_t cols, bool trans) {
    dnnl_dims_t dims = {rows, cols}, strides = {trans ? 1 : cols, trans ? rows : 1};
    return dnnl_memory_desc_init_by_strides(md, 2, dims, dt, strides);
}

/* The matmul of pass family; arguments src, weights, dst[, bias] as gemm_run passes them. */
static int gemm_pd(ampc_dnnl_entry *e, const conv_key *k, int family) {
    int rc = AMPC_OK;
    int64_t M = k->N * k->OH * k->OW;
    bool bias = family == AMPC_DNNL_CONV_FWD && k->has_bias;
    dnnl_memory_desc_t a, b, c, bmd;
    switch (family) {
    case AMPC_DNNL_CONV_FWD:
        AMPC_DNNL_TRY(mat_md(&a, k->dt, M, k->C, false), "x descriptor");
        AMPC_DNNL_TRY(mat_md(&b, k->dt, k->C, k->O, true), "w descriptor");
        AMPC_DNNL_TRY(mat_md(&c, k->dt, M, k->O, false), "y descriptor");
        AMPC_DNNL_TRY(mat_md(&bmd, k->dt, 1, k->O, false), "bias descriptor");
        break;
    case AMPC_DNNL_CONV_BWD_DATA:
        AMPC_DNNL_TRY(mat_md(&a, k->dt, M, k->O, false), "gy descriptor");
        AMPC_DNNL_TRY(mat_md(&b, k->dt, k->O, k->C, false), "w descriptor");
        AMPC_DNNL_TRY(mat_md(&c, k->dt, M, k->C, false), "gx descriptor");
        break;
    default:
        AMPC_DNNL_TRY(mat_md(&a, k->dt, k->O, M, true), "gy descriptor");
        AMPC_DNNL_TRY(mat_md(&b, k->dt, M, k->C, false), "x descriptor");
        AMPC_DNNL_TRY(mat_md(&c, k->grad_f32 ? dnnl_f32 : k->dt, k->O, k->C, false), "gw descriptor");
    }
    dnnl_matmul_desc_t op;
    AMPC_DNNL_TRY(dnnl_matmul_desc_init(&op, &a, &b, bias ? &bmd : NULL, &c), "matmul_desc_init");
    AMPC_DNNL_TRY(dnnl_primitive_desc_create(&e->pd, &op, ampc__dnnl_attr(), ampc__dnnl_engine(), NULL),
                  "convolution as matmul primitive_desc_create");
    if ((rc = ampc__dnnl_add_arg(e, DNNL_ARG_SRC, &a)) < 0 || (rc = ampc__dnnl_add_arg(e, DNNL_ARG_WEIGHTS, &b)) < 0 ||
        (rc = ampc__dnnl_add_arg(e, DNNL_ARG_DST, &c)) < 0)
        return rc;
    return bias ? ampc__dnnl_add_arg(e, DNNL_ARG_BIAS, &bmd) : AMPC_OK;
fail:
    return rc;
}

static int build_gemm_fwd(ampc_dnnl_entry *e, const void *key) { return gemm_pd(e, key, AMPC_DNNL_CONV_FWD); }
static int build_gemm_bwd_data(ampc_dnnl_entry *e, const void *key) { return gemm_pd(e, key, AMPC_DNNL_CONV_BWD_DATA); }
static int build_gemm_bwd_weights(ampc_dnnl_entry *e, const void *key) { return gemm_pd(e, key, AMPC_DNNL_CONV_BWD_WEIGHTS); }

static ampc_dnnl_build_fn i2c_builder(int family);

static ampc_dnnl_build_fn family_builder(int family, const conv_key *k) {
    if (k->im2col) return i2c_builder(family);
    if (k->gemm)
        return family == AMPC_DNNL_CONV_FWD ? build_gemm_fwd : family == AMPC_DNNL_CONV_BWD_DATA ? build_gemm_bwd_data
                                                                                                : build_gemm_bwd_weights;
    return family == AMPC_DNNL_CONV_FWD ? build_fwd : family == AMPC_DNNL_CONV_BWD_DATA ? build_bwd_data : build_bwd_weights;
}

/* Runs the gemm of pass family on the user's buffers (arg_spec order; lock held). */
static int gemm_run(int family, const conv_key *k, void *const *user) {
    ampc_dnnl_entry *e = ampc__dnnl_get(family, k, sizeof *k, family_builder(family, k));
    if (!e) return ampc_last_status();
    if (family != AMPC_DNNL_CONV_BWD_WEIGHTS) return ampc__dnnl_run(e, user);
    return ampc__dnnl_run(e, (void *[]){user[1], user[0], user[2]});   /* gy^T @ x */
}

// ---------------------------------------------------------------------------------------------
// Running a pass

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

/* The cached reorder from -> to for argument arg of pass family of k. Lock held. */
static ampc_dnnl_entry *reorder_entry(const conv_key *k, int family, int arg, const dnnl_memory_desc_t *from,
                                      const dnnl_memory_desc_t *to) {
    reorder_key rk;
    memset(&rk, 0, sizeof rk);
    rk.conv = *k;
    rk.family = family;
    rk.arg = arg;
    reorder_from = from;
    reorder_to = to;
    return ampc__dnnl_get(AMPC_DNNL_REORDER, &rk, sizeof rk, build_reorder);
}

/* Runs pass `family` of k on the user's plain buffers (one per argument, in arg_spec order):
   inputs reordered into workspace where the primitive wants another layout or dtype, outputs
   reordered back. Lock held. */
static int conv_run(int family, const conv_key *k, void *const *user) {
    int n, rc = AMPC_OK;
    const arg_spec *args = family_args(family, &n, k);
    ampc_dnnl_entry *e = ampc__dnnl_get(family, k, sizeof *k, family_builder(family, k));
    if (!e) return ampc_last_status();
    dnnl_memory_desc_t pmd[AMPC_DNNL_MAX_ARGS], umd[AMPC_DNNL_MAX_ARGS];
    ampc_dnnl_entry *reo[AMPC_DNNL_MAX_ARGS] = {0};
    size_t off[AMPC_DNNL_MAX_ARGS] = {0}, total = 0, block = 0;
    for (int i = 0; i < n; i++) {
        const dnnl_memory_desc_t *md;
        AMPC_DNNL_TRY(dnnl_memory_get_memory_desc(e->mem[i], &md), "memory_get_memory_desc");
        pmd[i] = *md;
        AMPC_DNNL_TRY(user_md(&umd[i], k, &args[i]), "user descriptor");
        if (dnnl_memory_desc_equal(&pmd[i], &umd[i])) continue;
        off[i] = total;
        total += align64(dnnl_memory_desc_get_size(&pmd[i]));
    }
    /* reorders (entries touched after e; e stays the most recent but them, so not evicted) */
    for (int i = 0; i < n; i++) {
        if (dnnl_memory_desc_equal(&pmd[i], &umd[i])) continue;
        reo[i] = args[i].output ? reorder_entry(k, family, args[i].arg, &pmd[i], &umd[i])
                                : reorder_entry(k, family, args[i].arg, &umd[i], &pmd[i]);
        if (!reo[i]) return ampc_last_status();
    }
    char *ws = NULL;
    if (total) {
        ws = ampc__alloc(AMPC_DEVICE_CPU, total, AMPC_MEM_WORKSPACE, &block);
        if (!ws) return ampc_last_status();
    }
    void *handles[AMPC_DNNL_MAX_ARGS];
    for (int i = 0; i < n && rc >= 0; i++) {
        handles[i] = reo[i] ? ws + off[i] : user[i];
        if (reo[i] && !args[i].output) rc = ampc__dnnl_run(reo[i], (void *[]){user[i], handles[i]});
    }
    if (rc >= 0) rc = ampc__dnnl_run(e, handles);
    for (int i = 0; i < n && rc >= 0; i++)
        if (reo[i] && args[i].output) rc = ampc__dnnl_run(reo[i], (void *[]){handles[i], user[i]});
    ampc__free(AMPC_DEVICE_CPU, ws, block, AMPC_MEM_WORKSPACE);
    return rc;
fail:
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Channels-last convolutions as im2col + one matmul
//
// In NHWC each output pixel's receptive field is KH*KW runs of C contiguous input values, so
// the columns matrix cols (R = N*OH*OW rows, K = KH*KW*C) is a copy of runs (zeros for the
// padding), and with the weights as W (O, K) in OHWI order every pass is one matmul:
//   forward          y       (R, O) = cols (R, K) @ W^T (K, O)   (+ bias), into y in place
//   backward data    gx_cols (R, K) = gy   (R, O) @ W   (O, K),  then col2im sums into gx
//   backward weights dW      (O, K) = gy^T (O, R) @ cols (R, K)  (gy^T is a stride, no copy)
// W is the OIHW weights reordered to OHWI, dW is reordered back to OIHW (f32 accumulation,
// rounded once for 16-bit gradients), the bias gradient is the column sums of gy. cols (and
// gx_cols, f32) are bounded by a cap: the batch is split into equal chunks of images, whose
// backward-weights matmuls accumulate into dW (a sum post-op). Only cl_im2col's shapes run it.

/* The cap on cols' bytes (32 MiB; what splitting costs: the top comment). Tests lower it to
   split small batches; not thread-safe, not part of the API. */
size_t ampc__cpu_conv_im2col_cap = (size_t)32 << 20;

/* The element size of cols: the operands' dtype, f32 for gx_cols (the matmul's output). */
static size_t i2c_cols_esz(int family, const conv_key *k) {
    return family == AMPC_DNNL_CONV_BWD_DATA || k->dt == dnnl_f32 ? 4 : 2;
}

/* Images per chunk: the fewest equal chunks whose cols fit the cap (at least one image). */
static int64_t i2c_chunk(int family, const conv_key *k) {
    size_t per = (size_t)(k->OH * k->OW * k->KH * k->KW * k->C) * i2c_cols_esz(family, k);
    int64_t fit = per ? (int64_t)(ampc__cpu_conv_im2col_cap / per) : k->N, nb = fit < 1 ? 1 : fit > k->N ? k->N : fit;
    int64_t chunks = (k->N + nb - 1) / nb;
    return (k->N + chunks - 1) / chunks;
}

/* The matmul of pass family for a chunk of k->N images (see above); arguments in run order:
   forward cols, W^T, y[, bias]; backward data gy, W, gx_cols; backward weights gy^T, cols, dW. */
static int i2c_pd(ampc_dnnl_entry *e, const conv_key *k, int family) {
    int rc = AMPC_OK;
    int64_t R = k->N * k->OH * k->OW, K = k->KH * k->KW * k->C;
    bool bias = family == AMPC_DNNL_CONV_FWD && k->has_bias;
    dnnl_memory_desc_t a, b, c, bmd;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    switch (family) {
    case AMPC_DNNL_CONV_FWD:
        AMPC_DNNL_TRY(mat_md(&a, k->dt, R, K, false), "cols descriptor");
        AMPC_DNNL_TRY(mat_md(&b, k->dt, K, k->O, true), "w descriptor");
        AMPC_DNNL_TRY(mat_md(&c, k->dt, R, k->O, false), "y descriptor");
        AMPC_DNNL_TRY(mat_md(&bmd, k->dt, 1, k->O, false), "bias descriptor");
        break;
    case AMPC_DNNL_CONV_BWD_DATA:
        AMPC_DNNL_TRY(mat_md(&a, k->dt, R, k->O, false), "gy descriptor");
        AMPC_DNNL_TRY(mat_md(&b, k->dt, k->O, K, false), "w descriptor");
        AMPC_DNNL_TRY(mat_md(&c, dnnl_f32, R, K, false), "gx cols descriptor");
        break;
    default:
        AMPC_DNNL_TRY(mat_md(&a, k->dt, k->O, R, true), "gy descriptor");
        AMPC_DNNL_TRY(mat_md(&b, k->dt, R, K, false), "cols descriptor");
        AMPC_DNNL_TRY(mat_md(&c, dnnl_f32, k->O, K, false), "dw descriptor");
    }
    AMPC_DNNL_TRY(dnnl_primitive_attr_create(&attr), "attr_create");
    AMPC_DNNL_TRY(dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user), "set_scratchpad_mode");
    if (k->accum) {
        AMPC_DNNL_TRY(dnnl_post_ops_create(&po), "post_ops_create");
        AMPC_DNNL_TRY(dnnl_post_ops_append_sum(po, 1.0f), "post_ops_append_sum");
        AMPC_DNNL_TRY(dnnl_primitive_attr_set_post_ops(attr, po), "set_post_ops");
    }
    dnnl_matmul_desc_t op;
    AMPC_DNNL_TRY(dnnl_matmul_desc_init(&op, &a, &b, bias ? &bmd : NULL, &c), "matmul_desc_init");
    AMPC_DNNL_TRY(dnnl_primitive_desc_create(&e->pd, &op, attr, ampc__dnnl_engine(), NULL),
                  "convolution as im2col matmul primitive_desc_create");
    if ((rc = ampc__dnnl_add_arg(e, DNNL_ARG_SRC, &a)) < 0 || (rc = ampc__dnnl_add_arg(e, DNNL_ARG_WEIGHTS, &b)) < 0 ||
        (rc = ampc__dnnl_add_arg(e, DNNL_ARG_DST, &c)) < 0)
        goto fail;
    if (bias) rc = ampc__dnnl_add_arg(e, DNNL_ARG_BIAS, &bmd);
fail:
    if (po) dnnl_post_ops_destroy(po);
    if (attr) dnnl_primitive_attr_destroy(attr);
    return rc;
}

static int build_i2c_fwd(ampc_dnnl_entry *e, const void *key) { return i2c_pd(e, key, AMPC_DNNL_CONV_FWD); }
static int build_i2c_bwd_data(ampc_dnnl_entry *e, const void *key) { return i2c_pd(e, key, AMPC_DNNL_CONV_BWD_DATA); }
static int build_i2c_bwd_weights(ampc_dnnl_entry *e, const void *key) { return i2c_pd(e, key, AMPC_DNNL_CONV_BWD_WEIGHTS); }

static ampc_dnnl_build_fn i2c_builder(int family) {
    return family == AMPC_DNNL_CONV_FWD ? build_i2c_fwd : family == AMPC_DNNL_CONV_BWD_DATA ? build_i2c_bwd_data
                                                                                          : build_i2c_bwd_weights;
}

/* Input row (h) or column of tap t of output index o, or -1 in the padding. */
static int64_t i2c_in(int64_t o, int64_t t, const conv_key *k, int i, int64_t size) {
    int64_t v = o * k->stride[i] - k->pad_l[i] + t * (k->dil[i] + 1);
    return v >= 0 && v < size ? v : -1;
}

/* cols (nb*OH*OW, KH*KW*C) of images [0, nb) of x (NHWC, esz-byte elements). */
static void im2col(const conv_key *k, int64_t nb, const char *x, char *cols, size_t esz) {
    int64_t R = nb * k->OH * k->OW;
    size_t run = (size_t)k->C * esz;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; r++) {
        int64_t n = r / (k->OH * k->OW), oh = r / k->OW % k->OH, ow = r % k->OW;
        char *dst = cols + (size_t)r * (size_t)(k->KH * k->KW) * run;
        for (int64_t kh = 0; kh < k->KH; kh++) {
            int64_t ih = i2c_in(oh, kh, k, 0, k->H);
            for (int64_t kw = 0; kw < k->KW; kw++, dst += run) {
                int64_t iw = ih < 0 ? -1 : i2c_in(ow, kw, k, 1, k->W);
                if (iw < 0) memset(dst, 0, run);
                else memcpy(dst, x + (size_t)((n * k->H + ih) * k->W + iw) * run, run);
            }
        }
    }
}

/* gx (images [0, nb), NHWC, f32 or bf16) = the sums of gx_cols (f32) over the taps that read
   each input pixel; each pixel gathers its taps, so threads never write the same value. */
static void col2im(const conv_key *k, int64_t nb, const float *gcols, void *gx, bool bf16) {
    int64_t P = nb * k->H * k->W, C = k->C, K = k->KH * k->KW * C;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < P; p++) {
        int64_t n = p / (k->H * k->W), ih = p / k->W % k->H, iw = p % k->W;
        for (int64_t c0 = 0; c0 < C; c0 += 256) {
            int64_t m = C - c0 < 256 ? C - c0 : 256;
            float acc[256] = {0};
            for (int64_t kh = 0; kh < k->KH; kh++) {
                int64_t th = ih + k->pad_l[0] - kh * (k->dil[0] + 1), oh = th / k->stride[0];
                if (th < 0 || th % k->stride[0] || oh >= k->OH) continue;
                for (int64_t kw = 0; kw < k->KW; kw++) {
                    int64_t tw = iw + k->pad_l[1] - kw * (k->dil[1] + 1), ow = tw / k->stride[1];
                    if (tw < 0 || tw % k->stride[1] || ow >= k->OW) continue;
                    const float *src = gcols + ((n * k->OH + oh) * k->OW + ow) * K + (kh * k->KW + kw) * C + c0;
                    for (int64_t c = 0; c < m; c++) acc[c] += src[c];
                }
            }
            for (int64_t c = 0; c < m; c++) ampc__cpu_st(gx, (size_t)(p * C + c0 + c), acc[c], bf16);
        }
    }
}

/* gb[o] (f32, or rounded to bf16) = the sum of column o of gy (R, O). */
static void i2c_bias_grad(const conv_key *k, const void *gy, void *gb, bool gb_bf16) {
    int64_t R = k->N * k->OH * k->OW, O = k->O;
    bool bf16 = k->dt == dnnl_bf16;
#pragma omp parallel for schedule(static)
    for (int64_t o0 = 0; o0 < O; o0 += 64) {
        int64_t m = O - o0 < 64 ? O - o0 : 64;
        float acc[64] = {0};
        for (int64_t r = 0; r < R; r++)
            for (int64_t o = 0; o < m; o++) acc[o] += ampc__cpu_ld(gy, (size_t)(r * O + o0 + o), bf16);
        for (int64_t o = 0; o < m; o++) ampc__cpu_st(gb, (size_t)(o0 + o), acc[o], gb_bf16);
    }
}

/* The reorder of the weights (or their gradient) between the user's OIHW in dt and OHWI in
   ohwi_dt; to_ohwi gives its direction. Lock held. */
static ampc_dnnl_entry *i2c_wei_reorder(const conv_key *k, int family, bool to_ohwi, dnnl_data_type_t dt,
                                        dnnl_data_type_t ohwi_dt) {
    dnnl_memory_desc_t oihw, ohwi;
    dnnl_dims_t dims = {k->O, k->C, k->KH, k->KW};
    if (dnnl_memory_desc_init_by_tag(&oihw, 4, dims, dt, dnnl_oihw) != dnnl_success ||
        dnnl_memory_desc_init_by_tag(&ohwi, 4, dims, ohwi_dt, dnnl_ohwi) != dnnl_success)
        return ampc__err_null(AMPC_ERR_BACKEND, "oneDNN: weight descriptors");
    conv_key kr = *k;
    kr.N = 0;   /* one reorder for every chunk size */
    return to_ohwi ? reorder_entry(&kr, family, DNNL_ARG_WEIGHTS, &oihw, &ohwi)
                   : reorder_entry(&kr, family, DNNL_ARG_DIFF_WEIGHTS, &ohwi, &oihw);
}

/* Runs pass family of k (ungrouped, channels-last, f32 or bf16) as im2col + matmul on the
   user's buffers (arg_spec order). Lock held. */
static int i2c_run(int family, const conv_key *k, void *const *user) {
    int rc = AMPC_OK;
    size_t esz = k->dt == dnnl_bf16 ? 2 : 4, cesz = i2c_cols_esz(family, k);
    int64_t K = k->KH * k->KW * k->C, nb = i2c_chunk(family, k), xpix = k->H * k->W, ypix = k->OH * k->OW;
    bool bwd_w = family == AMPC_DNNL_CONV_BWD_WEIGHTS, gf32 = k->dt == dnnl_f32 || k->grad_f32;
    ampc_dnnl_entry *wr = i2c_wei_reorder(k, family, !bwd_w, bwd_w ? (gf32 ? dnnl_f32 : dnnl_bf16) : k->dt,
                                          bwd_w ? dnnl_f32 : k->dt);
    if (!wr) return ampc_last_status();
    /* workspace: W (OHWI, dt) or dW (f32), then one chunk's cols */
    size_t wbytes = align64((size_t)(k->O * K) * (bwd_w ? 4 : esz)), block = 0;
    char *ws = ampc__alloc(AMPC_DEVICE_CPU, wbytes + (size_t)(nb * ypix * K) * cesz, AMPC_MEM_WORKSPACE, &block);
    if (!ws) return ampc_last_status();
    char *wbuf = ws, *cols = ws + wbytes;
    if (!bwd_w) rc = ampc__dnnl_run(wr, (void *[]){user[1], wbuf});
    for (int64_t n0 = 0; n0 < k->N && rc >= 0; n0 += nb) {
        /* the chunk's matmul: its own key (a smaller last chunk; later ones accumulate into dW) */
        conv_key kc = *k;
        kc.N = k->N - n0 < nb ? k->N - n0 : nb;
        kc.accum = bwd_w && n0 > 0;
        ampc_dnnl_entry *e = ampc__dnnl_get(family, &kc, sizeof kc, i2c_builder(family));
        if (!e) {
            rc = ampc_last_status();
            break;
        }
        /* offsets of image n0 in x (or gx) and y (or gy), NHWC */
        size_t xoff = (size_t)(n0 * xpix * k->C) * esz, yoff = (size_t)(n0 * ypix * k->O) * esz;
        if (family == AMPC_DNNL_CONV_FWD) {
            im2col(k, kc.N, (const char *)user[0] + xoff, cols, esz);
            rc = ampc__dnnl_run(e, (void *[]){cols, wbuf, (char *)user[2] + yoff, k->has_bias ? user[3] : NULL});
        } else if (family == AMPC_DNNL_CONV_BWD_DATA) {
            rc = ampc__dnnl_run(e, (void *[]){(char *)user[0] + yoff, wbuf, cols});
            if (rc >= 0) col2im(k, kc.N, (const float *)cols, (char *)user[2] + xoff, esz == 2);
        } else {
            im2col(k, kc.N, (const char *)user[0] + xoff, cols, esz);
            rc = ampc__dnnl_run(e, (void *[]){(char *)user[1] + yoff, cols, wbuf});
        }
    }
    if (bwd_w && rc >= 0) {
        rc = ampc__dnnl_run(wr, (void *[]){wbuf, user[2]});
        if (rc >= 0 && k->has_bias) i2c_bias_grad(k, user[1], user[3], !gf32);
    }
    ampc__free(AMPC_DEVICE_CPU, ws, block, AMPC_MEM_WORKSPACE);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// bf16 weight gradients split over threads
//
// oneDNN 2.6's jit_bf16 backward-weights kernel synchronises its threads with spin barriers
// (a shared transposition of the source, the reduction of per-thread gradients): when the OS
// deschedules one thread the others spin, so on a loaded machine the pass runs 10-100x slower
// (resnet18 amp-bf16 at 4-25 GFLOP/s, steps of 2-3 s instead of 0.5). Instead each thread runs
// a one-thread primitive (no barrier inside) on a slice of the work:
// - of the output channels (16-channel blocks) when the weights outnumber the input values:
//   each slice writes its rows of the gradient, no reduction;
// - else of the batch, each slice into an f32 partial gradient, summed in a fixed order.
// On an idle machine both run as fast as oneDNN's own threading (see the top comment).

#define MAX_SLICES AMPC_DNNL_MAX_STREAMS

/* First unit of slice s of S over n units (the first n % S slices get one more). */
static int64_t slice_start(int64_t n, int S, int s) { return s * (n / S) + (s < n % S ? s : n % S); }

typedef struct {
    bool by_oc;
    int S;
} split_plan;

/* First image (or output channel) of slice s. */
static int64_t plan_start(const conv_key *k, const split_plan *p, int s) {
    if (!p->by_oc) return slice_start(k->N, p->S, s);
    int64_t o = 16 * slice_start((k->O + 15) / 16, p->S, s);
    return o < k->O ? o : k->O;
}

/* The one-thread primitives of the slices (keys with slot 1..S). Lock held. */
static int slice_entries(const conv_key *k, const split_plan *p, ampc_dnnl_entry **e) {
    int nthr = omp_get_max_threads(), s = 0;
    omp_set_num_threads(1);   /* oneDNN sizes a primitive's threading at creation */
    for (; s < p->S; s++) {
        conv_key ks = *k;
        int64_t size = plan_start(k, p, s + 1) - plan_start(k, p, s);
        if (p->by_oc) ks.O = size;
        else ks.N = size;
        ks.nthr = 1;
        ks.slot = s + 1;
        if (!(e[s] = ampc__dnnl_get(AMPC_DNNL_CONV_BWD_WEIGHTS, &ks, sizeof ks, build_bwd_weights))) break;
    }
    omp_set_num_threads(nthr);
    return s < p->S ? ampc_last_status() : AMPC_OK;
}

/* Runs slice s's entry with handles h[s] and scratchpad scratch[s] on the threads of a
   parallel region, each slice on its own stream. */
static int run_slices(ampc_dnnl_entry **e, int S, void *const (*h)[4], char *const *scratch) {
    dnnl_status_t st[MAX_SLICES];
    int rc = ampc__dnnl_reserve_streams(S);
    if (rc < 0) return rc;
#pragma omp parallel num_threads(S)
    for (int s = omp_get_thread_num(); s < S; s += omp_get_num_threads()) st[s] = ampc__dnnl_exec(e[s], h[s], scratch[s], s);
    for (int s = 0; s < S; s++)
        if (st[s] != dnnl_success)
            return ampc__err(AMPC_ERR_BACKEND, "oneDNN convolution backward weights slice: %s", dnnl_status2str(st[s]));
    return AMPC_OK;
}

/* md (a slice's src or diff_dst) widened to batch N, if the batch is its outermost, unblocked
   dimension: then image i starts i * strides[0] elements in. */
static bool widen_batch(dnnl_memory_desc_t *full, const dnnl_memory_desc_t *md, int64_t N) {
    const dnnl_blocking_desc_t *b = &md->format_desc.blocking;
    if (md->format_kind != dnnl_blocked || md->offset0 != 0 || md->extra.flags != 0) return false;
    for (int i = 0; i < b->inner_nblks; i++)
        if (b->inner_idxs[i] == 0) return false;
    if ((size_t)(b->strides[0] * md->padded_dims[0]) * dnnl_data_type_size(md->data_type) != dnnl_memory_desc_get_size(md))
        return false;
    *full = *md;
    full->dims[0] = full->padded_dims[0] = N;
    return true;
}

static const dnnl_memory_desc_t *arg_md(const ampc_dnnl_entry *e, int i) {
    const dnnl_memory_desc_t *md = NULL;
    return dnnl_memory_get_memory_desc(e->mem[i], &md) == dnnl_success ? md : NULL;
}

/* Split over the batch (see above); 1 when a layout does not have the batch outermost. */
static int split_batch(const conv_key *k, const split_plan *p, ampc_dnnl_entry **e, void *const *user) {
    int S = p->S, n, rc = AMPC_OK;
    const arg_spec *args = family_args(AMPC_DNNL_CONV_BWD_WEIGHTS, &n, k);
    /* slice descriptors (src, diff_dst, diff_weights, diff_bias): the same in every slice
       but the batch; full: the whole batch's src and diff_dst */
    dnnl_memory_desc_t pmd[4], umd[4], full[2], w;
    for (int s = 0; s < S; s++)
        for (int i = 0; i < n; i++) {
            const dnnl_memory_desc_t *md = arg_md(e[s], i);
            if (!md) return ampc__err(AMPC_ERR_BACKEND, "oneDNN convolution: no descriptor for argument %d", i);
            if (s == 0 && i < 2 && !widen_batch(&full[i], md, k->N)) return 1;
            if (s == 0) pmd[i] = *md;
            if (i < 2 ? !widen_batch(&w, md, k->N) || !dnnl_memory_desc_equal(&w, &full[i]) : !dnnl_memory_desc_equal(md, &pmd[i]))
                return 1;
        }
    for (int i = 0; i < n; i++) AMPC_DNNL_TRY(user_md(&umd[i], k, &args[i]), "user descriptor");

    /* workspace: the whole src and diff_dst where reordered, S partial gradients (slot 0's
       in the user's buffer when it has the layout), S scratchpads */
    conv_key kr = *k;
    kr.slot = -1;
    ampc_dnnl_entry *reo[4] = {0};
    size_t off[4] = {0}, total = 0, block = 0, bytes[4];
    for (int i = 0; i < n; i++) {
        const dnnl_memory_desc_t *md = i < 2 ? &full[i] : &pmd[i];
        bytes[i] = dnnl_memory_desc_get_size(md);
        bool same = dnnl_memory_desc_equal(md, &umd[i]);
        if (!same) reo[i] = args[i].output ? reorder_entry(&kr, AMPC_DNNL_CONV_BWD_WEIGHTS, args[i].arg, md, &umd[i])
                                           : reorder_entry(&kr, AMPC_DNNL_CONV_BWD_WEIGHTS, args[i].arg, &umd[i], md);
        if (!same && !reo[i]) return ampc_last_status();
        off[i] = total;
        total += i < 2 ? (same ? 0 : align64(bytes[i])) : (size_t)S * align64(bytes[i]);
    }
    char *scratch[MAX_SLICES], *out[4][MAX_SLICES], *in[2];
    size_t part = total;
    for (int s = 0; s < S; s++) total += align64(e[s]->scratch_bytes);
    char *ws = ampc__alloc(AMPC_DEVICE_CPU, total, AMPC_MEM_WORKSPACE, &block);
    if (!ws) return ampc_last_status();
    for (int s = 0; s < S; part += align64(e[s]->scratch_bytes), s++) scratch[s] = ws + part;
    for (int i = 2; i < n; i++)
        for (int s = 0; s < S; s++) out[i][s] = s == 0 && !reo[i] ? user[i] : ws + off[i] + (size_t)s * align64(bytes[i]);
    for (int i = 0; i < 2 && rc >= 0; i++) {
        in[i] = reo[i] ? ws + off[i] : user[i];
        if (reo[i]) rc = ampc__dnnl_run(reo[i], (void *[]){user[i], in[i]});
    }
    void *h[MAX_SLICES][4];
    for (int s = 0; s < S; s++) {
        size_t i0 = (size_t)plan_start(k, p, s);
        h[s][0] = in[0] + i0 * (bytes[0] / (size_t)k->N);
        h[s][1] = in[1] + i0 * (bytes[1] / (size_t)k->N);
        h[s][2] = out[2][s];
        h[s][3] = n > 3 ? out[3][s] : NULL;
    }
    if (rc >= 0) rc = run_slices(e, S, (void *const(*)[4])h, scratch);
    /* sum the partials into slot 0's (f32: the weights' and bias' layouts hold floats) */
    for (int i = 2; i < n && rc >= 0; i++) {
        size_t m = bytes[i] / sizeof(float);
        float *const *q = (float *const *)out[i];
#pragma omp parallel for schedule(static) if (m > 32768)
        for (size_t j = 0; j < m; j++) {
            float v = q[0][j];
            for (int s = 1; s < S; s++) v += q[s][j];
            q[0][j] = v;
        }
        if (reo[i]) rc = ampc__dnnl_run(reo[i], (void *[]){out[i][0], user[i]});
    }
    ampc__free(AMPC_DEVICE_CPU, ws, block, AMPC_MEM_WORKSPACE);
    return rc;
fail:
    return rc;
}

/* Split over the output channels (see above): every slice reads the whole src and its own
   channels of diff_dst (reordered from a view of the user's), and writes its rows of the
   user's gradients. 1 when the slices disagree on the src layout. */
static int split_oc(const conv_key *k, const split_plan *p, ampc_dnnl_entry **e, void *const *user) {
    int S = p->S, n, rc = AMPC_OK;
    const arg_spec *args = family_args(AMPC_DNNL_CONV_BWD_WEIGHTS, &n, k);
    dnnl_memory_desc_t umd[4];
    for (int i = 0; i < n; i++) AMPC_DNNL_TRY(user_md(&umd[i], k, &args[i]), "user descriptor");
    /* per slice and argument: the reorder between the slice's layout and the view of the
       user's buffer (diff_dst (N, os, OH, OW), weights (os, C, KH, KW), bias (os) at o0), or
       none where they agree (an f32 bias: written in place); the src once, by slice 0 */
    ampc_dnnl_entry *reo[MAX_SLICES][4] = {{0}};
    size_t off[MAX_SLICES][4] = {{0}}, view_off[MAX_SLICES][4] = {{0}}, total = 0, block = 0;
    for (int s = 0; s < S; s++) {
        int64_t o0 = plan_start(k, p, s), os = plan_start(k, p, s + 1) - o0;
        conv_key kr = *k;
        kr.slot = -2 - s;
        const dnnl_memory_desc_t *src = arg_md(e[s], 0), *src0 = arg_md(e[0], 0);
        if (!src || !src0 || !dnnl_memory_desc_equal(src, src0)) return 1;
        for (int i = s == 0 ? 0 : 1; i < n; i++) {
            const dnnl_memory_desc_t *md = arg_md(e[s], i);
            if (!md) return ampc__err(AMPC_ERR_BACKEND, "oneDNN convolution: no descriptor for argument %d", i);
            dnnl_memory_desc_t view = umd[i], at0;
            if (i > 0) {
                dnnl_dims_t dims = {0}, offs = {0};
                for (int d = 0; d < umd[i].ndims; d++) dims[d] = umd[i].dims[d];
                dims[i == 1] = os, offs[i == 1] = o0;   /* channels: dim 1 of diff_dst, dim 0 of the others */
                AMPC_DNNL_TRY(dnnl_memory_desc_init_submemory(&view, &umd[i], dims, offs), "memory_desc_init_submemory");
            }
            view_off[s][i] = (size_t)view.offset0 * dnnl_data_type_size(view.data_type);
            at0 = view;
            at0.offset0 = 0;
            if (dnnl_memory_desc_equal(md, &at0)) continue;
            reo[s][i] = args[i].output ? reorder_entry(&kr, AMPC_DNNL_CONV_BWD_WEIGHTS, args[i].arg, md, &view)
                                       : reorder_entry(&kr, AMPC_DNNL_CONV_BWD_WEIGHTS, args[i].arg, &view, md);
            if (!reo[s][i]) return ampc_last_status();
            off[s][i] = total;
            total += align64(dnnl_memory_desc_get_size(md));
        }
    }
    size_t part = total;
    for (int s = 0; s < S; s++) total += align64(e[s]->scratch_bytes);
    char *ws = ampc__alloc(AMPC_DEVICE_CPU, total ? total : 64, AMPC_MEM_WORKSPACE, &block);
    if (!ws) return ampc_last_status();
    char *scratch[MAX_SLICES];
    void *h[MAX_SLICES][4];
    for (int s = 0; s < S; part += align64(e[s]->scratch_bytes), s++) {
        scratch[s] = ws + part;
        for (int i = 0; i < n; i++) {
            int r = i == 0 ? 0 : s;   /* the src: slice 0's buffer for all */
            h[s][i] = reo[r][i] ? ws + off[r][i] : (char *)user[i] + view_off[r][i];
        }
    }
    /* the src once, each slice's channels of diff_dst in; gradients out (reorders take the
       view's offset from its descriptor, so they get the user's base pointer) */
    for (int s = 0; s < S && rc >= 0; s++)
        for (int i = s == 0 ? 0 : 1; i < 2 && rc >= 0; i++)
            if (reo[s][i]) rc = ampc__dnnl_run(reo[s][i], (void *[]){user[i], h[s][i]});
    if (rc >= 0) rc = run_slices(e, S, (void *const(*)[4])h, scratch);
    for (int s = 0; s < S && rc >= 0; s++)
        for (int i = 2; i < n && rc >= 0; i++)
            if (reo[s][i]) rc = ampc__dnnl_run(reo[s][i], (void *[]){h[s][i], user[i]});
    ampc__free(AMPC_DEVICE_CPU, ws, block, AMPC_MEM_WORKSPACE);
    return rc;
fail:
    return rc;
}

/* The backward weights pass of k (blocked bf16) split over threads, on the user's plain
   buffers like conv_run; 1 when it does not apply (fewer than 2 threads or units of work, a
   layout the split cannot slice). Lock held. */
static int conv_run_split(const conv_key *k, void *const *user) {
    split_plan p = {.by_oc = k->groups == 1 && k->O * k->C * k->KH * k->KW > k->N * k->C * k->H * k->W};
    int64_t units = p.by_oc ? (k->O + 15) / 16 : k->N, S = k->nthr < units ? k->nthr : units;
    p.S = (int)(S < MAX_SLICES ? S : MAX_SLICES);
    if (p.S < 2) return 1;
    ampc_dnnl_entry *e[MAX_SLICES];
    int rc = slice_entries(k, &p, e);
    if (rc < 0) return rc;
    return p.by_oc ? split_oc(k, &p, e, user) : split_batch(k, &p, e, user);
}

/* Runs pass family of k on the user's plain buffers (conv_run, or split for bf16 weights). */
static int conv_exec(int family, const conv_key *k, void *const *user) {
    if (k->gemm) return gemm_run(family, k, user);
    if (k->im2col) return i2c_run(family, k, user);
    if (family == AMPC_DNNL_CONV_BWD_WEIGHTS && k->dt == dnnl_bf16 && k->blocked) {
        int rc = conv_run_split(k, user);
        if (rc != 1) return rc;
    }
    return conv_run(family, k, user);
}

// ---------------------------------------------------------------------------------------------
// Kernels

static int64_t conv_out(int64_t in, int64_t k, int s, int p, int d) { return (in + 2 * p - (int64_t)d * (k - 1) - 1) / s + 1; }

/* Whether pass `family` runs on plain NCHW (see the 1x1 table at the top): ungrouped unpadded
   1x1 convolutions are gemms over NCHW, faster than the blocked kernels with their reorders
   on maps of 10x10 and more; strided, the gemm needs an im2col copy first, which only the data
   gradient (a scatter) and the bf16 weight gradient still win. On small maps (7x7: 49-column
   gemms per image) the blocked kernels win, and oneDNN's gemm weight gradient would take
   48-96 MiB of scratchpad there. */
static bool plain_1x1(int family, const ampc_conv_desc *d, ampc_dtype dt) {
    if (d->KH != 1 || d->KW != 1 || d->groups != 1 || d->padding[0] || d->padding[1]) return false;
    bool unit_stride = d->stride[0] == 1 && d->stride[1] == 1;
    if (d->OH * d->OW < 100) return false;
    return family == AMPC_DNNL_CONV_BWD_DATA || unit_stride || (family == AMPC_DNNL_CONV_BWD_WEIGHTS && dt == AMPC_BF16);
}

// Channels-last choices, per pass (measured: the NHWC table at the top). Activations stay NHWC
// (no reorder) but where noted; weights are reordered to oneDNN's choice as on the NCHW path.

static bool is_1x1_s1(const ampc_conv_desc *d) {
    return d->KH == 1 && d->KW == 1 && d->groups == 1 && !d->padding[0] && !d->padding[1] && d->stride[0] == 1 &&
           d->stride[1] == 1;
}

/* Stride-1 1x1: one gemm (gemm_pd), faster than oneDNN's NHWC 1x1 kernels in f32 and as fast in
   bf16 - but for bf16 weight gradients on maps above 28x28 (64->256 56x56: 5.9 vs 8.1 ms, 256->64
   3.3 vs 4.0), where the gemm reduces over all N*H*W pixels. A bias gradient needs the
   convolution. */
static bool cl_gemm(int family, const ampc_conv_desc *d, bool bf16, bool has_bias) {
    if (!is_1x1_s1(d)) return false;
    if (family != AMPC_DNNL_CONV_BWD_WEIGHTS) return true;
    return !has_bias && (!bf16 || d->OH * d->OW <= 28 * 28);
}

/* Forward: oneDNN 2.6 picks brgconv for NHWC; its jit kernels (the NCHW path's, which take
   NHWC too) are faster for bf16 everywhere (4x4: 4.3 vs 7.9 ms) and for f32 on small output
   maps, strided 1x1 and few input values per output (cnn's 1-channel conv1); brgconv is faster
   for f32 on larger maps (3x3 56x56: 8.8 vs 9.3, 3x3 s2 56x56: 9.2 vs 12.5 ms). */
static bool cl_no_brg(const ampc_conv_desc *d, bool bf16) {
    bool strided_1x1 = d->KH == 1 && d->KW == 1 && (d->stride[0] > 1 || d->stride[1] > 1);
    return bf16 || d->OH * d->OW < 64 || strided_1x1 || d->C / d->groups * d->KH * d->KW < 16;
}

/* The f32 passes whose NHWC kernels lose to the blocked ones by more than the reorders cost:
   backward data on 4x4 maps (11.6 vs 9.6 ms), backward weights of strided or unpadded spatial
   kernels on output maps of 24x24 and more (3x3 s2 56x56: 22.7 vs 15.4 ms; cnn conv2: 14.7 vs
   11.3 ms) - but the 3-channel stems (16.5 vs 21.5 ms the other way). */
static bool cl_reorder(int family, const ampc_conv_desc *d, bool bf16) {
    if (bf16) return false;
    bool strided = d->stride[0] > 1 || d->stride[1] > 1, unpadded = !d->padding[0] && !d->padding[1];
    if (family == AMPC_DNNL_CONV_BWD_DATA) return d->H * d->W <= 16;
    if (family == AMPC_DNNL_CONV_BWD_WEIGHTS)
        return d->KH * d->KW > 1 && d->OH * d->OW >= 24 * 24 && (unpadded || (strided && d->C >= 16));
    return false;
}

/* im2col + matmul for pass family (see i2c_run)? -1: by cl_im2col, 0: never, 1: wherever it
   applies (ungrouped, channels-last, not a 1x1 gemm). For benchmarks and tests (declared in
   cpu.h); not thread-safe, not part of the API. */
int ampc__cpu_conv_im2col = -1;

/* Backward weights as im2col + matmul (i2c_run) where oneDNN's direct kernels are weak: many
   output channels on small output maps (at most 14x14), strided (3x3 s2 256->512 8x8 bf16:
   7.1 vs 3.3 ms) or with many input channels (3x3 512->512 4x4 bf16: 10.8 vs 8.5 ms); in f32
   only strided with at least 256 input channels and K = KH*KW*C >= 1024 (the others within
   10% or slower). Forward and backward data lose everywhere (oneDNN's direct kernels run near
   peak; building cols, and col2im, cost more than they could save). See the im2col table at
   the top. */
static bool cl_im2col(int family, const ampc_conv_desc *d, bool bf16) {
    if (d->groups != 1 || is_1x1_s1(d)) return false;
    if (ampc__cpu_conv_im2col >= 0) return ampc__cpu_conv_im2col;
    if (family != AMPC_DNNL_CONV_BWD_WEIGHTS || d->O < 256 || d->OH * d->OW > 14 * 14) return false;
    bool strided = d->stride[0] > 1 || d->stride[1] > 1;
    int64_t K = d->KH * d->KW * d->C;
    if (bf16) return K >= 256 && (strided || d->C >= 512);
    return strided && d->C >= 256 && K >= 1024;
}

/* grad_dt: the dtype of gw/gb for the backward weights pass (dt elsewhere). */
static conv_key make_key(int family, const ampc_conv_desc *d, ampc_dtype dt, ampc_dtype grad_dt, bool has_bias) {
    conv_key k;
    memset(&k, 0, sizeof k);
    k.dt = dt == AMPC_BF16 ? dnnl_bf16 : dnnl_f32;
    k.grad_f32 = dt == AMPC_BF16 && grad_dt == AMPC_F32;   /* f16 runs in f32 anyway */
    k.has_bias = has_bias;
    if (d->channels_last) {
        bool bf16 = dt == AMPC_BF16;
        k.cl = 1;
        k.gemm = cl_gemm(family, d, bf16, has_bias);
        k.im2col = !k.gemm && cl_im2col(family, d, bf16);
        k.blocked = !k.gemm && !k.im2col;   /* weights: oneDNN's layout */
        k.no_brg = k.blocked && family == AMPC_DNNL_CONV_FWD && cl_no_brg(d, bf16);
        k.cl_reorder = k.blocked && cl_reorder(family, d, bf16);
    } else {
        k.blocked = !plain_1x1(family, d, dt);
    }
    k.nthr = omp_get_max_threads();
    k.N = d->N, k.C = d->C, k.H = d->H, k.W = d->W, k.O = d->O, k.KH = d->KH, k.KW = d->KW, k.OH = d->OH, k.OW = d->OW;
    k.groups = d->groups;
    const int64_t in[2] = {d->H, d->W}, ker[2] = {d->KH, d->KW}, out[2] = {d->OH, d->OW};
    for (int i = 0; i < 2; i++) {
        k.stride[i] = d->stride[i];
        k.dil[i] = d->dilation[i] - 1;
        k.pad_l[i] = d->padding[i];
        /* oneDNN needs (in + pad_l + pad_r - extent) / stride + 1 == out. The exact remainder
           may make the right padding negative (rows the floor drops); any value up to
           stride - 1 above it gives the same output, and nothing reads the extra padding. */
        int64_t extent = (ker[i] - 1) * d->dilation[i] + 1, r = (out[i] - 1) * d->stride[i] + extent - in[i] - d->padding[i];
        k.pad_r[i] = r < 0 ? 0 : r;
    }
    return k;
}

/* grads: w and b are the weight and bias gradients, which may be f32 for 16-bit x and y (then
   both are). */
static int check(const ampc_conv_desc *d, const char *what, const ampc_tensor *x, const ampc_tensor *w, const ampc_tensor *y,
                 const ampc_tensor *b, bool grads) {
    ampc_dtype dt = x->dtype, wdt = grads && w->dtype == AMPC_F32 ? AMPC_F32 : dt;
    if (dt != AMPC_F32 && dt != AMPC_F16 && dt != AMPC_BF16)
        return ampc__err(AMPC_ERR_DTYPE, "%s on %s tensors", what, ampc_dtype_name(dt));
    if (w->dtype != wdt || y->dtype != dt || (b && b->dtype != wdt))
        return ampc__err(AMPC_ERR_DTYPE, "%s: operands of different dtypes", what);
    if (ampc__is_cl(x) != d->channels_last || ampc__is_cl(y) != d->channels_last || ampc__is_cl(w))
        return ampc__err(AMPC_ERR_INVALID, "%s: activations must be %s as the descriptor says, weights OIHW", what,
                         d->channels_last ? "channels-last" : "contiguous");
    if (d->N < 0 || d->C < 0 || d->H < 0 || d->W < 0 || d->O < 0 || d->KH < 1 || d->KW < 1 || d->groups < 1 ||
        d->C % d->groups || d->O % d->groups)
        return ampc__err(AMPC_ERR_INVALID, "%s: invalid descriptor", what);
    for (int i = 0; i < 2; i++)
        if (d->stride[i] < 1 || d->dilation[i] < 1 || d->padding[i] < 0)
            return ampc__err(AMPC_ERR_INVALID, "%s: invalid stride, dilation or padding", what);
    if (d->OH != conv_out(d->H, d->KH, d->stride[0], d->padding[0], d->dilation[0]) ||
        d->OW != conv_out(d->W, d->KW, d->stride[1], d->padding[1], d->dilation[1]) || d->OH < 1 || d->OW < 1)
        return ampc__err(AMPC_ERR_INVALID, "%s: output size %lldx%lld does not match the descriptor", what, (long long)d->OH,
                         (long long)d->OW);
    if (x->numel != d->N * d->C * d->H * d->W || w->numel != d->O * (d->C / d->groups) * d->KH * d->KW ||
        y->numel != d->N * d->O * d->OH * d->OW || (b && b->numel != d->O))
        return ampc__err(AMPC_ERR_INVALID, "%s: a tensor's size does not match the descriptor", what);
    return AMPC_OK;
}

/* f16 operands as f32 workspace: n values of each f16 tensor converted in (inputs) or
   allocated (outputs), one block; f32 tensors (f32 weight gradients) are used in place. */
typedef struct {
    float *p[4];
    void *block;
    size_t bytes;
} f32_copies;

static int widen(f32_copies *c, const ampc_tensor *const *t, const bool *is_input, int n) {
    size_t total = 0, off[4];
    for (int i = 0; i < n; i++) {
        off[i] = total;
        total += t[i] && t[i]->dtype == AMPC_F16 ? align64((size_t)t[i]->numel * sizeof(float)) : 0;
    }
    memset(c, 0, sizeof *c);
    c->block = ampc__alloc(AMPC_DEVICE_CPU, total ? total : 64, AMPC_MEM_WORKSPACE, &c->bytes);
    if (!c->block) return ampc_last_status();
    for (int i = 0; i < n; i++) {
        if (!t[i]) continue;
        if (t[i]->dtype == AMPC_F32) {
            c->p[i] = ampc__data(t[i]);
            continue;
        }
        c->p[i] = (float *)((char *)c->block + off[i]);
        if (is_input[i]) ampc__dt(AMPC_F16)->to_f32(ampc__data(t[i]), c->p[i], (size_t)t[i]->numel);
    }
    return AMPC_OK;
}

static void narrow(f32_copies *c, ampc_tensor *const *t, const bool *is_output, int n, int rc) {
    for (int i = 0; i < n && rc >= 0; i++)
        if (t[i] && is_output[i] && t[i]->dtype == AMPC_F16)
            ampc__dt(AMPC_F16)->from_f32(c->p[i], ampc__data(t[i]), (size_t)t[i]->numel);
    ampc__free(AMPC_DEVICE_CPU, c->block, c->bytes, AMPC_MEM_WORKSPACE);
}

/* Runs pass family with tensors t (arg_spec order; NULL bias allowed at the end), going
   through f32 copies for f16. */
static int run_tensors(int family, const ampc_conv_desc *d, ampc_tensor *const *t, int n, bool has_bias) {
    int nargs;
    ampc_dtype grad_dt = family == AMPC_DNNL_CONV_BWD_WEIGHTS ? t[2]->dtype : t[0]->dtype;
    conv_key k = make_key(family, d, t[0]->dtype, grad_dt, has_bias);
    const arg_spec *args = family_args(family, &nargs, &k);
    void *user[4];
    int rc;
    if (t[0]->dtype != AMPC_F16) {
        for (int i = 0; i < n; i++) user[i] = t[i] ? ampc__data(t[i]) : NULL;
        ampc__dnnl_lock();
        rc = conv_exec(family, &k, user);
        ampc__dnnl_unlock();
        return rc;
    }
    bool in[4], out[4];
    for (int i = 0; i < n; i++) in[i] = !args[i].output, out[i] = args[i].output;
    f32_copies c;
    if ((rc = widen(&c, (const ampc_tensor *const *)t, in, n)) < 0) return rc;
    for (int i = 0; i < n; i++) user[i] = c.p[i];
    ampc__dnnl_lock();
    rc = conv_exec(family, &k, user);
    ampc__dnnl_unlock();
    narrow(&c, t, out, n, rc);
    return rc;
}

/* Empty reductions (no input channels, no batch): outputs are the bias or zero. */
static int fill_zero(ampc_tensor *t) {
    if (t) memset(ampc__data(t), 0, ampc__nbytes(t));   /* all-zero bits are 0.0 in f32/f16/bf16 */
    return AMPC_OK;
}

/* gb[o] = sum of gy[:, o] in f32, for inputs oneDNN cannot take (an empty x under padding). */
static int bias_grad(const ampc_conv_desc *d, const ampc_tensor *gy, ampc_tensor *gb) {
    size_t plane = (size_t)(d->OH * d->OW), O = (size_t)d->O;
    for (size_t o = 0; o < O; o++) {
        float s = 0, buf[AMPC_CPU_CHUNK], one[1];
        for (size_t n = 0; n < (size_t)d->N; n++)
            for (size_t j = 0; j < plane; j += d->channels_last ? 1 : AMPC_CPU_CHUNK) {
                if (d->channels_last) {   /* channel o of pixel j: one value, O apart (a rare path) */
                    s += *ampc__cpu_load(gy, (n * plane + j) * O + o, 1, buf);
                    continue;
                }
                size_t m = plane - j < AMPC_CPU_CHUNK ? plane - j : AMPC_CPU_CHUNK;
                const float *v = ampc__cpu_load(gy, (n * O + o) * plane + j, m, buf);
                for (size_t i = 0; i < m; i++) s += v[i];
            }
        *ampc__cpu_out(gb, (size_t)o, one) = s;
        ampc__cpu_store(gb, (size_t)o, 1, one);
    }
    return AMPC_OK;
}

static int cpu_conv2d(const ampc_conv_desc *d, const ampc_tensor *x, const ampc_tensor *w, const ampc_tensor *b,
                      ampc_tensor *y) {
    int rc = check(d, "conv2d", x, w, y, b, false);
    if (rc < 0 || y->numel == 0) return rc;
    if (x->numel == 0) {   /* C == 0: y = bias broadcast over (N, OH, OW) */
        size_t sz = ampc__dt(y->dtype)->size, plane = (size_t)(d->OH * d->OW), O = (size_t)d->O;
        char *out = ampc__data(y);
        for (size_t p = 0; p < (size_t)y->numel; p++) {
            size_t o = d->channels_last ? p % O : p / plane % O;
            if (b) memcpy(out + p * sz, (const char *)ampc__data(b) + o * sz, sz);
            else memset(out + p * sz, 0, sz);
        }
        return AMPC_OK;
    }
    return run_tensors(AMPC_DNNL_CONV_FWD, d, (ampc_tensor *[]){(ampc_tensor *)x, (ampc_tensor *)w, y, (ampc_tensor *)b},
                       b ? 4 : 3, b != NULL);
}

static int cpu_conv2d_backward_data(const ampc_conv_desc *d, const ampc_tensor *gy, const ampc_tensor *w, ampc_tensor *gx) {
    int rc = check(d, "conv2d_backward_data", gx, w, gy, NULL, false);
    if (rc < 0 || gx->numel == 0) return rc;
    if (gy->numel == 0) return fill_zero(gx);   /* O == 0 */
    return run_tensors(AMPC_DNNL_CONV_BWD_DATA, d, (ampc_tensor *[]){(ampc_tensor *)gy, (ampc_tensor *)w, gx}, 3, false);
}

static int cpu_conv2d_backward_weights(const ampc_conv_desc *d, const ampc_tensor *x, const ampc_tensor *gy, ampc_tensor *gw,
                                       ampc_tensor *gb) {
    if (!gw) return ampc__err(AMPC_ERR_INVALID, "conv2d_backward_weights: no weight gradient tensor");
    int rc = check(d, "conv2d_backward_weights", x, gw, gy, gb, true);
    if (rc < 0) return rc;
    if (gy->numel == 0 || x->numel == 0) {   /* N == 0, O == 0, or an empty input: empty sums */
        if (gb && gy->numel) bias_grad(d, gy, gb);
        else fill_zero(gb);
        return fill_zero(gw);
    }
    return run_tensors(AMPC_DNNL_CONV_BWD_WEIGHTS, d, (ampc_tensor *[]){(ampc_tensor *)x, (ampc_tensor *)gy, gw, gb},
                       gb ? 4 : 3, gb != NULL);
}

// ---------------------------------------------------------------------------------------------
// Introspection and registration

int ampc__cpu_conv_impl(const ampc_conv_desc *d, ampc_dtype dt, int pass, bool has_bias, char *buf, size_t n) {
    static const int families[3] = {AMPC_DNNL_CONV_FWD, AMPC_DNNL_CONV_BWD_DATA, AMPC_DNNL_CONV_BWD_WEIGHTS};
    if (pass < 0 || pass > 2) return ampc__err(AMPC_ERR_INVALID, "conv pass %d", pass);
    conv_key k = make_key(families[pass], d, dt, dt, has_bias && pass != 1);
    if (k.im2col) k.N = i2c_chunk(families[pass], &k);   /* the matmul of a chunk */
    ampc__dnnl_lock();
    ampc_dnnl_entry *e = ampc__dnnl_get(families[pass], &k, sizeof k, family_builder(families[pass], &k));
    snprintf(buf, n, "%s%s", k.im2col ? "im2col+" : "", e ? ampc__dnnl_impl(e) : "?");
    ampc__dnnl_unlock();
    return e ? AMPC_OK : ampc_last_status();
}

void ampc__cpu_register_conv(ampc_backend *be) {
    be->conv2d = cpu_conv2d;
    be->conv2d_backward_data = cpu_conv2d_backward_data;
    be->conv2d_backward_weights = cpu_conv2d_backward_weights;
}
