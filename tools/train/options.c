/*
 * options.c - ampc-train's options: one table (OPTS) drives parsing, defaults, --help, the printed
 * configuration, the checkpoint's metadata (meta.c) and the checks of --resume. A value is kept
 * as canonical text ("yes", "0.001", "536870912"), the form the checkpoint stores; getopt_long
 * reads the command line ('--flag value' or '--flag=value'; exact names only, as before).
 */
#include "train.h"
#include "size.h"

#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <strings.h>

// ---------------------------------------------------------------------------------------------
// The table

#define INT_FLAG_MAX 9.2e18   /* the bound of the unbounded integer flags: under INT64_MAX */
const opt_def OPTS[OPT_COUNT] = {
    [OPT_MODEL] = {"model", V_CHOICE, "cnn", "mlp|cnn|resnet18|resnet50|gpt", 0, 0, false, O_SAVE | O_RUN, "NAME",
                   "mlp, cnn (PyTorch's MNIST example net), resnet18 or resnet50 (torchvision's), or gpt (nanoGPT's "
                   "GPT, a language model: --data is a text file or llm.c's .bin tokens; see --block-size)"},
    [OPT_DATA] = {"data", V_TEXT, "", NULL, 0, 0, false, O_SAVE | O_RESTORE, "DIR",
                  "a folder with IDX files ({train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]) or an image folder "
                  "(one subfolder of .jpg/.png images per class); default: Fashion-MNIST from Debian's "
                  "dataset-fashion-mnist (or $AMPC_FASHION_MNIST_DIR). --model gpt: a FILE, text read as bytes "
                  "(vocabulary 256) or llm.c's pre-tokenised .bin (GPT-2 tokens), its tail (--val-split) held out"},
    [OPT_BATCH_SIZE] = {"batch-size", V_INT, "64", NULL, 1, 1 << 20, false, O_SAVE | O_RUN, "N", "samples per step"},
    [OPT_USE_AMP] = {"use-amp", V_YESNO, "yes", NULL, 0, 0, false, O_SAVE | O_RUN | O_REMEDY, "yes|no",
                     "automatic mixed precision (autocast) for training and validation"},
    [OPT_AMP_DTYPE] = {"amp-dtype", V_CHOICE, "auto", "bf16|fp16|fastest", 0, 0, false, O_SAVE | O_RUN | O_REMEDY | O_AUTO,
                       "bf16|fp16|fastest",
                       "autocast's lower precision (auto: bf16 where the CPU has bf16 arithmetic, AVX512-BF16 or AMX; "
                       "fp16 elsewhere; fastest: a few training steps of this model and batch timed in fp32, bf16 and "
                       "fp16 before training, and the fastest kept, fp32 meaning --use-amp no)"},
    [OPT_GRAD_SCALER] = {"grad-scaler", V_YESNO, "auto", NULL, 0, 0, false, O_SAVE | O_RUN | O_REMEDY | O_AUTO, "yes|no",
                         "loss scaling (auto: yes for fp16 autocast, no for bf16 and fp32)"},
    [OPT_EPOCHS] = {"epochs", V_INT, "5", NULL, 0, MAX_EPOCHS, false, O_SAVE | O_RESTORE, "N",
                    "epochs in all (with --resume: the total, including the finished ones; 0: print the setup "
                    "and stop)"},
    [OPT_LR] = {"lr", V_REAL, "auto", NULL, 0, 1e6, true, O_SAVE | O_RUN | O_REMEDY | O_AUTO, "X",
                "learning rate (auto: 0.01 for sgd, 0.001 for adam/adamw)"},
    [OPT_OPTIMIZER] = {"optimizer", V_CHOICE, "auto", "sgd|adam|adamw", 0, 0, false, O_SAVE | O_RUN | O_AUTO, "NAME",
                       "sgd (with --momentum), adam or adamw (auto: adamw for gpt, with no weight decay on biases, "
                       "norms and embeddings, as nanoGPT; adam otherwise)"},
    [OPT_MOMENTUM] = {"momentum", V_REAL, "0.9", NULL, 0, 1, false, O_SAVE | O_RUN, "X", "SGD momentum, in [0, 1)"},
    [OPT_WEIGHT_DECAY] = {"weight-decay", V_REAL, "auto", NULL, 0, 1e6, false, O_SAVE | O_RUN | O_AUTO, "X",
                          "L2 penalty (auto: 0, or 0.01 for adamw as in PyTorch, 0.1 for gpt as nanoGPT)"},
    [OPT_SEED] = {"seed", V_INT, "1", NULL, 0, INT_FLAG_MAX, false, O_SAVE | O_RUN, "N",
                  "seeds initialisation, dropout, shuffling and the validation split"},
    [OPT_VAL_SPLIT] = {"val-split", V_REAL, "0.1", NULL, 0, 1, true, O_SAVE | O_RUN, "X",
                       "fraction held out for validation when the data has no test set (image folders; for gpt the "
                       "token file's tail)"},
    [OPT_IMAGE_SIZE] = {"image-size", V_INT, "auto", NULL, 8, 4096, false, O_SAVE | O_RUN | O_AUTO, "N",
                        "images are resized to N x N (auto: 28 for IDX data and for mlp/cnn, 64 for ResNets on "
                        "folders; ResNets use the small-input stem for N <= 64)"},
    [OPT_INDEX_CSV] = {"index-csv", V_TEXT, "", NULL, 0, 0, false, O_SAVE | O_RESTORE, "FILE",
                       "image folders: CSV index (image_path,target) read instead of scanning; written after "
                       "the scan when FILE does not exist (the usual preprocess step)"},
    [OPT_LIMIT_TRAIN] = {"limit-train", V_INT, "0", NULL, 0, INT_FLAG_MAX, false, O_SAVE | O_RUN, "N",
                         "use only the first N training samples (0: all)"},
    [OPT_LIMIT_VAL] = {"limit-val", V_INT, "0", NULL, 0, INT_FLAG_MAX, false, O_SAVE | O_RUN, "N",
                       "use only the first N validation samples (0: all)"},
    [OPT_THREADS] = {"threads", V_INT, "auto", NULL, 1, 1024, false, O_SAVE | O_AUTO, "N",
                     "compute threads (auto: OpenMP's default, $OMP_NUM_THREADS or the cores)"},
    [OPT_DEVICE] = {"device", V_CHOICE, "cpu", "cpu|cuda", 0, 0, false, O_SAVE, "NAME",
                    "where the model trains: cpu, or cuda (an NVIDIA GPU, in builds with AMPC_CUDA: GPU 0, or under "
                    "mpirun each process the GPU of its rank on its machine, modulo the GPUs there), or cuda:N (GPU N)"},
    [OPT_NUM_WORKERS] = {"num-workers", V_INT, "auto", NULL, 0, 64, false, O_SAVE | O_AUTO, "N",
                         "data loader threads (auto: 0 for IDX data, 2 for image folders)"},
    [OPT_PIN_MEMORY] = {"pin-memory", V_YESNO, "no", NULL, 0, 0, false, 0, "yes|no",
                        "on a GPU, the loader hands out batches already on it: with --num-workers > 0 its buffers "
                        "page-locked and each batch copied on the GPU's copy stream beside the previous step "
                        "(PyTorch's pin_memory with non_blocking copies); no: one copy per batch before its step"},
    [OPT_MAX_MEMORY] = {"max-memory", V_SIZE, "none", NULL, 0, 0, false, O_SAVE, "SIZE",
                        "memory budget emulating a device of that size, e.g. 512M, 2G, 1.5GiB (K, M, G, T are "
                        "powers of 1024; none: what the machine or its cgroup allows at start)"},
    [OPT_OUT] = {"out", V_TEXT, "auto", NULL, 0, 0, false, O_SAVE | O_AUTO, "DIR",
                 "the run's folder, created if needed; one that holds a run is refused (see --overwrite) (auto: "
                 "runs/<--name>, or a new runs/<date>-<time>, with runs/latest linking to it; with --resume: the "
                 "checkpoint's folder)"},
    [OPT_NAME] = {"name", V_TEXT, "auto", NULL, 0, 0, false, O_AUTO, "NAME",
                  "the run's folder is runs/NAME (letters, digits, '.', '-', '_'; auto: the date and time the run "
                  "starts, as runs/20261127-093012)"},
    [OPT_OVERWRITE] = {"overwrite", V_YESNO, "no", NULL, 0, 0, false, 0, "yes|no",
                       "start afresh in an --out folder that holds an earlier run: that run's files (metrics, plots, "
                       "logs, checkpoints) are deleted first (no: the folder is refused, so no run is ever lost)"},
    [OPT_RESUME] = {"resume", V_TEXT, "", NULL, 0, 0, false, 0, "FILE", "continue the run saved in this checkpoint"},
    [OPT_PROGRESS] = {"progress", V_CHOICE, "auto", "auto|bar|lines|off", 0, 0, false, 0, "MODE",
                      "progress display (auto: a bar when stdout is a terminal, a line per 10% otherwise and under mpirun)"},
    [OPT_CHANNELS_LAST] = {"channels-last", V_YESNO, "yes", NULL, 0, 0, false, O_SAVE, "yes|no",
                           "cnn/ResNet activations in channels-last memory format (faster: no layout reorders "
                           "around the convolutions; the same results up to summation order)"},
    [OPT_KEEP_CASTS] = {"keep-casts", V_YESNO, "yes", NULL, 0, 0, false, O_SAVE, "yes|no",
                        "keep autocast's 16-bit weight copies across steps, rewritten by the optimizer's pass "
                        "(faster, bit-identical results; no: recast every step as PyTorch does, 2 bytes per "
                        "parameter less while the optimizer steps)"},
    [OPT_MAX_SKIPPED] = {"max-skipped-steps", V_INT, "30", NULL, 0, 1e9, false, O_SAVE | O_RESTORE, "N",
                         "stop as diverged when the grad scaler skips N steps in a row (inf/NaN gradients at every "
                         "scale it tried; 0: never)"},
    [OPT_MIN_LOSS_SCALE] = {"min-loss-scale", V_REAL, "5.960464477539062e-08", NULL, 0, 1e30, false, O_SAVE | O_RESTORE, "X",
                            "stop as diverged when the grad scaler's loss scale falls below X (the default, 2^-24: below "
                            "it every fp16 gradient of a loss <= 1 underflows; 0: never)"},
    [OPT_MAX_LOSS] = {"max-loss", V_REAL, "1e+04", NULL, 0, 1e300, true, O_SAVE | O_RESTORE, "X",
                      "stop as diverged when a training step's loss exceeds X (cross-entropy starts near ln(classes))"},
    [OPT_SYNC_BN] = {"sync-bn", V_YESNO, "no", NULL, 0, 0, false, O_SAVE, "[yes|no]",
                     "under mpirun: BatchNorm with the batch statistics of all processes (SyncBatchNorm; alone: yes); "
                     "no: each process normalises with its own batch's, as DDP"},
    [OPT_ZERO] = {"zero", V_INT, "0", NULL, 0, 1, false, O_SAVE, "0|1",
                  "under mpirun: 1 shards the optimizer state across the processes (ZeRO stage 1: each steps its "
                  "share of the fp32 weights and moments, then all gather the weights); 0: every process holds it all"},
    [OPT_LR_SCHEDULE] = {"lr-schedule", V_CHOICE, "constant", "constant|step|cosine", 0, 0, false, O_SAVE | O_RUN, "NAME",
                         "learning rate by optimizer step, as PyTorch's schedulers: constant, step (StepLR: times "
                         "--lr-gamma every --lr-step-size epochs) or cosine (CosineAnnealingLR to 0 over the run); "
                         "steps the GradScaler skips do not advance it"},
    [OPT_LR_STEP_SIZE] = {"lr-step-size", V_INT, "1", NULL, 1, 1e9, false, O_SAVE | O_RUN, "N",
                          "--lr-schedule step: epochs between decays (their optimizer steps)"},
    [OPT_LR_GAMMA] = {"lr-gamma", V_REAL, "0.1", NULL, 0, 1, false, O_SAVE | O_RUN, "X", "--lr-schedule step: the decay factor"},
    [OPT_WARMUP_STEPS] = {"warmup-steps", V_INT, "0", NULL, 0, INT_FLAG_MAX, false, O_SAVE | O_RUN, "N",
                          "linear warm-up first over N optimizer steps from a third of --lr (LinearLR's default), then "
                          "the schedule (SequentialLR)"},
    [OPT_CLIP_GRAD_NORM] = {"clip-grad-norm", V_REAL, "0", NULL, 0, 1e30, false, O_SAVE | O_RUN | O_REMEDY, "X",
                            "clip the gradients' total 2-norm to X before each step, on the unscaled gradients "
                            "(the GradScaler's unscale first, as PyTorch's recipe; 0: off)"},
    [OPT_PRETRAINED] = {"pretrained", V_TEXT, "", NULL, 0, 0, false, O_SAVE, "FILE",
                        "start from these weights: a safetensors state_dict (ampc's model.safetensors or checkpoint, or "
                        "a PyTorch .pth converted by scripts/pth_to_safetensors.py; torchvision's names)"},
    [OPT_PRETRAINED_STRICT] = {"pretrained-strict", V_CHOICE, "yes", "yes|head|no", 0, 0, false, O_SAVE, "yes|head|no",
                               "--pretrained: every tensor must match (yes); all but the classifier head (fc; the cnn's "
                               "fc2), which may be missing or of another shape and is kept new, such as a head for another "
                               "number of classes (head); or load what matches in name and shape and keep the rest new (no)"},
    [OPT_FREEZE] = {"freeze", V_CHOICE, "none", "none|backbone", 0, 0, false, O_SAVE | O_RUN, "WHAT",
                    "backbone: train only the classifier head (fc; the cnn's fc2, the mlp's last layer), the other "
                    "parameters frozen (requires_grad off; BatchNorm statistics still update in training, as PyTorch)"},
    [OPT_STOP_AFTER_STEPS] = {"stop-after-steps", V_INT, "0", NULL, 0, INT_FLAG_MAX, false, 0, "N",
                              "train N optimizer steps in this session, then save a checkpoint and stop as SIGTERM does, with "
                              "exit status 0 (a run cut into time-limited jobs; 0: no limit)"},
    [OPT_AUGMENT] = {"augment", V_CHOICE, "auto", "none|flip|ssr|flip+ssr", 0, 0, false, O_SAVE | O_RUN | O_AUTO, "WHAT",
                     "training-image augmentation, drawn per sample from --seed (the same on resume and for any "
                     "--num-workers): flip (horizontal, p 0.5), ssr (albumentations' ShiftScaleRotate: shift 0.3, scale "
                     "0.3, rotation 15 degrees, p 0.5, bilinear, borders mirrored as OpenCV's BORDER_REFLECT_101), "
                     "flip+ssr (both: the transfer-learning tutorial's) or none (auto: flip for image folders, none "
                     "for IDX data)"},
    [OPT_EXCLUDE_CLASS] = {"exclude-class", V_TEXT, "", NULL, 0, 0, false, O_SAVE | O_RUN, "PATTERNS",
                           "image folders: leave these classes out, as if their folders were not there (comma-separated "
                           "shell patterns of class folder names; a numbered name such as Caltech-256's 257.clutter also "
                           "matches by its part after the dot: --exclude-class clutter)"},
    [OPT_ACCUMULATE] = {"accumulate", V_INT, "1", NULL, 1, 65536, false, O_SAVE | O_RUN, "N",
                        "gradient accumulation: N batches per optimizer step, each loss divided by N, one unscale, "
                        "clip and step (an effective batch of N x --batch-size; the last group of an epoch may be "
                        "shorter and is divided by its own length; under mpirun, one all-reduce per step)"},
    [OPT_STEP_LOG] = {"step-log", V_YESNO, "yes", NULL, 0, 0, false, O_SAVE | O_RESTORE, "yes|no",
                      "steps.csv in --out: a row per optimizer step (step, epoch, batch, loss, scale, skipped, lr, "
                      "samples_per_s; under mpirun the job's loss, all processes' samples), and the plots drawn from it: "
                      "steps.png (the loss and the throughput per step), with the grad scaler scale.png (the loss scale "
                      "over the run with the skipped steps marked), and with --compare compare.png (fp32 and AMP overlaid)"},
    [OPT_DOCTOR] = {"doctor", V_YESNO, "no", NULL, 0, 0, false, O_SAVE | O_RESTORE, "yes|no",
                    "the numerics doctor: on a skipped step (and when the run diverges), name the first op, forward or "
                    "backward, whose output went NaN/inf, by module path, and whether a smaller loss scale fixes it "
                    "(scale-induced) or not (intrinsic); costs a pass over each op's output"},
    [OPT_EXPLAIN] = {"explain", V_YESNO, "no", NULL, 0, 0, false, 0, "yes|no",
                     "print every op of this session's first training step: module, op, autocast policy, the dtypes "
                     "given and run, the output's, and the bytes autocast spent on casts"},
    [OPT_FP32_MODULES] = {"fp32-modules", V_TEXT, "", NULL, 0, 0, false, O_SAVE | O_RUN | O_REMEDY, "PATTERNS",
                          "under autocast, run these modules in fp32 (comma-separated shell patterns of module paths, "
                          "e.g. 'layer4.*' or fc; a module's children with it), as Keras' per-layer float32 policy"},
    [OPT_NUMERICS_EVERY] = {"numerics-every", V_INT, "0", NULL, 0, INT_FLAG_MAX, false, O_SAVE | O_RESTORE, "K",
                            "every K-th optimizer step, per op: the amax of its outputs and gradients and the share of "
                            "values the 16-bit type flushes to zero, keeps only as subnormals or saturates at the current "
                            "loss scale; a table at the end and numerics.csv in --out (0: off)"},
    [OPT_COLLECTIVE_TIMEOUT] = {"collective-timeout", V_INT, "1800", NULL, 0, 1e9, false, 0, "SECONDS",
                                "under mpirun: the longest any process waits in a collective (an all-reduce, a broadcast) "
                                "for the others; past it the job ends naming the step and the collective (a process "
                                "stopped, hung or dead; 0: wait for ever)"},
    [OPT_LABEL_SMOOTHING] = {"label-smoothing", V_REAL, "0", NULL, 0, 1, false, O_SAVE | O_RUN, "X",
                             "the training loss is PyTorch's CrossEntropyLoss(label_smoothing=X): the target mixes the "
                             "true class (1 - X) with a uniform share X over the classes; validation keeps plain cross "
                             "entropy, as timm does, so its loss stays comparable (0: off)"},
    [OPT_EVAL_ONLY] = {"eval-only", V_YESNO, "no", NULL, 0, 0, false, 0, "yes|no",
                       "evaluate the model of --resume's checkpoint or --pretrained's weights on the validation data "
                       "(loss, accuracy, each class's accuracy) and stop: no training, no files written "
                       "(torchvision's train.py --test-only)"},
    [OPT_TENSORBOARD] = {"tensorboard", V_YESNO, "yes", NULL, 0, 0, false, O_SAVE | O_RESTORE, "yes|no",
                         "a TensorBoard event file in --out (tensorboard --logdir runs): per optimizer step train/loss, "
                         "train/lr, train/skipped_steps, train/samples_per_s and, with the grad scaler, train/loss_scale; "
                         "per epoch epoch/train_loss, epoch/val_loss, epoch/train_accuracy, epoch/val_accuracy, epoch/lr, "
                         "epoch/samples_per_s, epoch/skipped_steps"},
    [OPT_BLOCK_SIZE] = {"block-size", V_INT, "auto", NULL, 1, 1 << 20, false, O_SAVE | O_RUN | O_AUTO, "N",
                        "gpt: tokens per sample, the context length (auto: 128); a sample is a window of N + 1 tokens "
                        "of --data, an epoch every window once, cut at a random place each epoch"},
    [OPT_N_LAYER] = {"n-layer", V_INT, "4", NULL, 1, 1024, false, O_SAVE | O_RUN, "N", "gpt: transformer blocks"},
    [OPT_N_HEAD] = {"n-head", V_INT, "4", NULL, 1, 1024, false, O_SAVE | O_RUN, "N", "gpt: attention heads (--n-embd a multiple of it)"},
    [OPT_N_EMBD] = {"n-embd", V_INT, "128", NULL, 1, 1 << 16, false, O_SAVE | O_RUN, "N", "gpt: the model's width"},
    [OPT_DROPOUT] = {"dropout", V_REAL, "0", NULL, 0, 0.99, false, O_SAVE | O_RUN, "X",
                     "gpt: dropout after the embeddings and on attention's and the MLP's outputs, in training"},
    [OPT_BIAS] = {"bias", V_YESNO, "yes", NULL, 0, 0, false, O_SAVE | O_RUN, "yes|no",
                  "gpt: biases in the Linear and LayerNorm layers (GPT-2 has them; nanoGPT's bias=False has none)"},
    [OPT_SAMPLE] = {"sample", V_INT, "0", NULL, 0, 1 << 20, false, 0, "N",
                    "gpt: after training (or with --eval-only, from --resume's checkpoint or --pretrained's weights) "
                    "generate N tokens from --prompt and print them (text for a byte vocabulary)"},
    [OPT_TEMPERATURE] = {"temperature", V_REAL, "0.8", NULL, 0, 100, true, 0, "X",
                         "--sample: the logits are divided by X (below 1: surer, above: more random)"},
    [OPT_TOP_K] = {"top-k", V_INT, "200", NULL, 0, 1 << 30, false, 0, "K", "--sample: draw among the K likeliest tokens (0: all)"},
    [OPT_PROMPT] = {"prompt", V_TEXT, "", NULL, 0, 0, false, 0, "TEXT",
                    "--sample: the text the generation continues (a byte vocabulary; default a newline), or "
                    "comma-separated token ids"},
};


// ---------------------------------------------------------------------------------------------
// Settings: the canonical text of every option

bool option_applies(const char *model, int i) {
    const bool gpt = strcmp(model, "gpt") == 0;
    if (i == OPT_IMAGE_SIZE || i == OPT_AUGMENT || i == OPT_CHANNELS_LAST) return !gpt;
    if (i >= OPT_BLOCK_SIZE && i <= OPT_PROMPT) return gpt;
    return true;
}

void settings_free(settings *s) {
    for (int i = 0; i < OPT_COUNT; i++) free(s->val[i]);
    memset(s, 0, sizeof *s);
}

int set_val(settings *s, int i, const char *text) {
    char *c = strdup(text);
    if (!c) return fail("out of memory");
    free(s->val[i]);
    s->val[i] = c;
    return 0;
}

int settings_copy(settings *dst, const settings *src) {
    memset(dst, 0, sizeof *dst);
    for (int i = 0; i < OPT_COUNT; i++)
        if (set_val(dst, i, src->val[i]) < 0) return -1;
    memcpy(dst->given, src->given, sizeof dst->given);
    dst->compare = src->compare;
    dst->link_latest = src->link_latest;
    dst->dated = src->dated;
    return 0;
}

int canonical(int i, const char *text, char *out, size_t n, char *err, size_t errn) {
    const opt_def *o = &OPTS[i];
    if ((o->flags & O_AUTO) && strcmp(text, "auto") == 0) {
        snprintf(out, n, "auto");
        return 0;
    }
    switch (o->kind) {
    case V_CHOICE: {
        int gpu = -1, used = 0;
        if (i == OPT_DEVICE && sscanf(text, "cuda:%4d%n", &gpu, &used) == 1 && !text[used] && isdigit((unsigned char)text[5]) &&
            gpu >= 0) {   /* a GPU by its number */
            snprintf(out, n, "cuda:%d", gpu);
            return 0;
        }
        size_t len = strlen(text);
        for (const char *c = o->choices; *c;) {
            const char *bar = strchr(c, '|');
            size_t l = bar ? (size_t)(bar - c) : strlen(c);
            if (l == len && strncmp(c, text, l) == 0) {
                snprintf(out, n, "%s", text);
                return 0;
            }
            c += l + (bar ? 1 : 0);
        }
        return snprintf(err, errn, "--%s takes %s, not '%s'", o->name, i == OPT_DEVICE ? "cpu, cuda or cuda:N (a GPU's number)" : o->choices,
                        text), -1;
    }
    case V_YESNO:
        if (!strcmp(text, "yes") || !strcmp(text, "true") || !strcmp(text, "on") || !strcmp(text, "1")) snprintf(out, n, "yes");
        else if (!strcmp(text, "no") || !strcmp(text, "false") || !strcmp(text, "off") || !strcmp(text, "0")) snprintf(out, n, "no");
        else return snprintf(err, errn, "--%s takes yes or no, not '%s'", o->name, text), -1;
        return 0;
    case V_INT: {
        char *end;
        errno = 0;
        long long v = strtoll(text, &end, 10);
        if (!*text || *end || errno || (double)v < o->lo || (double)v > o->hi)
            return snprintf(err, errn, "--%s takes an integer in [%.0f, %.0f], not '%s'", o->name, o->lo, o->hi, text), -1;
        snprintf(out, n, "%lld", v);
        return 0;
    }
    case V_REAL: {
        char *end;
        errno = 0;
        double v = strtod(text, &end);
        bool ok = *text && !*end && !errno && isfinite(v) && (o->lo_open ? v > o->lo : v >= o->lo) &&
                  (i == OPT_MOMENTUM || i == OPT_VAL_SPLIT ? v < o->hi : v <= o->hi);
        if (!ok) {
            char lo[32], hi[32];
            bool hi_open = i == OPT_MOMENTUM || i == OPT_VAL_SPLIT;
            return snprintf(err, errn, "--%s takes a number in %c%s, %s%c, not '%s'", o->name, o->lo_open ? '(' : '[',
                               fmt_real(o->lo, lo, sizeof lo), fmt_real(o->hi, hi, sizeof hi), hi_open ? ')' : ']', text), -1;
        }
        fmt_real(v, out, n);
        return 0;
    }
    case V_SIZE: {
        double b;
        if (strcmp(text, "none") == 0 || strcmp(text, "0") == 0) {
            snprintf(out, n, "none");
            return 0;
        }
        if (!tool_parse_size(text, &b) || b < 1)
            return snprintf(err, errn, "--%s takes a size like 512M, 2G or 1.5GiB (or none), not '%s'", o->name, text), -1;
        snprintf(out, n, "%.0f", b);
        return 0;
    }
    case V_TEXT:
        if (i != OPT_DATA && i != OPT_INDEX_CSV && i != OPT_EXCLUDE_CLASS && i != OPT_FP32_MODULES && i != OPT_PROMPT && !*text) return snprintf(err, errn, "--%s needs a value", o->name), -1;
        /* the checkpoint's metadata records it, and safetensors' JSON header holds UTF-8 only:
           refused now rather than at the first save, after an epoch of training */
        if ((o->flags & O_SAVE) && !ampc_checkpoint_meta_text_valid(text))
            return snprintf(err, errn, "--%s is not valid UTF-8 text (the checkpoint's metadata records it): rename it", o->name), -1;
        snprintf(out, n, "%s", text);
        return 0;
    }
    return snprintf(err, errn, "--%s: internal error", o->name), -1;
}

/* "  --flag METAVAR   help text" with the text wrapped at 100 columns under its first line. */
static void print_option(const char *flag, const char *text) {
    printf("  %-26s ", flag);
    int col = 29;
    for (const char *w = text; *w;) {
        while (*w == ' ') w++;
        size_t len = strcspn(w, " ");
        if (col > 29 && col + 1 + (int)len > 100) {
            printf("\n%29s", "");
            col = 29;
        }
        printf("%s%.*s", col > 29 ? " " : "", (int)len, w);
        col += (col > 29) + (int)len;
        w += len;
    }
    printf("\n");
}

void print_help(void) {
    printf("usage: " PROG " [options]\n"
           "Trains an image classifier with automatic mixed precision: the cnn on Fashion-MNIST by default.\n\n");
    for (int i = 0; i < OPT_COUNT; i++) {
        const opt_def *o = &OPTS[i];
        char flag[64], text[1024];
        snprintf(flag, sizeof flag, "--%s %s", o->name, o->metavar);
        snprintf(text, sizeof text, "%s%s%s%s", o->help, *o->def && strcmp(o->def, "auto") != 0 ? " [default: " : "",
                 *o->def && strcmp(o->def, "auto") != 0 ? o->def : "", *o->def && strcmp(o->def, "auto") != 0 ? "]" : "");
        print_option(flag, text);
    }
    print_option("--compare", "train twice, fp32 then AMP (--amp-dtype), into <out>/fp32 and <out>/amp, and print both "
                              "side by side (make demo)");
    print_option("--compare-checkpoints A B", "exit 0 if the two checkpoints hold bit-identical tensors (weights, "
                                              "buffers and optimizer state), 1 if not");
    print_option("--help", "this text");
    print_option("--version", "ampc's version and licence");
    printf("\nDefaults: the cnn, Adam lr 0.001, batch 64 (PyTorch's MNIST example's batch), 5 epochs, bf16 autocast:\n"
           "about 91-92%% test accuracy on Fashion-MNIST. Data is normalised (Fashion-MNIST's or MNIST's mean/std;\n"
           "ImageNet's for image folders, whose training images are also mirrored at random).\n"
           "\nEach epoch prints one line: losses and accuracies, the epoch's and the training loop's wall time,\n"
           "the training throughput, the mean time per step and the data wait, the share of the training loop's\n"
           "time spent getting batches from the data loader (decoding them with --num-workers 0, waiting for the\n"
           "workers otherwise).\n"
           "\nOutputs in --out: metrics.csv (per epoch: epoch, train_loss, train_acc, val_loss, val_acc, seconds,\n"
           "samples_per_s, scale, skipped_steps, data_wait; accuracies are fractions, seconds the epoch's wall\n"
           "time, samples_per_s the training throughput, scale and skipped_steps the grad scaler's scale at the\n"
           "end of the epoch and the steps it skipped in it, data_wait the data wait as a fraction; nan for\n"
           "epochs resumed from a checkpoint that did not record it), loss.png, accuracy.png,\n"
           "checkpoint.safetensors (replaced after every epoch), model.safetensors (the state_dict alone) and,\n"
           "with --step-log yes, steps.csv and scale.png. Each step the grad scaler skips prints a line (at most\n"
           "one per 2 s). Flags take '--flag value' or '--flag=value'.\n"
           "Errors print one line \"" PROG ": error: ...\" on stderr; exit status 1 (2: bad command line, 3: the run\n"
           "diverged). SIGINT/SIGTERM save a checkpoint at the next step and exit 128 + signal (130, 143).\n"
           "\nWhen the grad scaler gives up (--max-skipped-steps in a row, or the scale below --min-loss-scale),\n"
           "the run saves where it stopped to diverged.safetensors (the last good checkpoint stays) and names\n"
           "remedies. A resumed run keeps its configuration, but for these, which may be given anew as remedies:\n"
           "--lr, --use-amp, --amp-dtype, --grad-scaler, --fp32-modules, --clip-grad-norm (a change of precision,\n"
           "or a resumed diverged.safetensors, starts the grad scaler afresh).\n");
}

// ---------------------------------------------------------------------------------------------
// The command line

enum { LONG_COMPARE = 256 + OPT_COUNT, LONG_COMPARE_CHECKPOINTS, LONG_HELP, LONG_VERSION };   /* past the options' 256 + id */

/* The option in longopts named exactly like the argument "--name[=value]", or NULL (getopt_long
   also takes unambiguous abbreviations, which ampc-train never did). */
static const struct option *exact_option(const struct option *longopts, const char *arg, size_t *len) {
    *len = strcspn(arg + 2, "=");
    for (const struct option *o = longopts; o->name; o++)
        if (strlen(o->name) == *len && strncmp(o->name, arg + 2, *len) == 0) return o;
    return NULL;
}

/* The Levenshtein distance between a (n bytes) and b, case-sensitive; SIZE_MAX for a b of 64
   bytes or more (no flag is that long). */
static size_t edit_distance(const char *a, size_t n, const char *b) {
    size_t m = strlen(b), row[64];
    if (m >= 64) return SIZE_MAX;
    for (size_t j = 0; j <= m; j++) row[j] = j;
    for (size_t i = 1; i <= n; i++) {
        size_t diag = row[0];   /* row[i-1][j-1] */
        row[0] = i;
        for (size_t j = 1; j <= m; j++) {
            size_t up = row[j], best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best) best = up + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[m];
}

/* " (did you mean --epochs?)" for the unknown name (len bytes) into buf, or "": the flags it
   begins when there are at most three (--limit: --limit-train or --limit-val), or else the nearest
   by edit distance when they are close: at most 2 edits, or a third of the name for long ones,
   and never the whole name ("--x" is 2 edits from "--lr", and no typo of it). Ties are all named:
   picking one would be a guess. */
static const char *did_you_mean(const struct option *longopts, const char *name, size_t len, char *buf, size_t n) {
    size_t prefixes = 0, best = SIZE_MAX, at = 0;
    for (const struct option *o = longopts; o->name; o++) {
        prefixes += len > 0 && strncmp(o->name, name, len) == 0;
        size_t d = len < 64 ? edit_distance(name, len, o->name) : SIZE_MAX;   /* longer than any flag by far */
        best = d < best ? d : best;
    }
    const bool by_prefix = prefixes >= 1 && prefixes <= 3;
    const bool close = best <= (len / 3 > 2 ? len / 3 : 2) && best < len;
    buf[0] = '\0';
    for (const struct option *o = longopts; o->name && (by_prefix || close); o++)
        if (by_prefix ? strncmp(o->name, name, len) == 0 : edit_distance(name, len, o->name) == best)
            appendf(buf, n, &at, "%s--%s", at ? " or " : " (did you mean ", o->name);
    if (at) appendf(buf, n, &at, "?)");
    return buf;
}

/* A yes/no flag that may stand alone for yes ("--sync-bn"). */
static bool bare(int id) { return id == OPT_SYNC_BN; }

int parse_args(int argc, char **argv, settings *s, const char **cmp_a, const char **cmp_b) {
    memset(s, 0, sizeof *s);
    for (int i = 0; i < OPT_COUNT; i++)
        if (set_val(s, i, OPTS[i].def) < 0) return -1;
    struct option longopts[OPT_COUNT + 5];
    for (int i = 0; i < OPT_COUNT; i++)
        longopts[i] = (struct option){OPTS[i].name, bare(i) ? optional_argument : required_argument, NULL, 256 + i};
    longopts[OPT_COUNT] = (struct option){"compare", no_argument, NULL, LONG_COMPARE};
    longopts[OPT_COUNT + 1] = (struct option){"compare-checkpoints", no_argument, NULL, LONG_COMPARE_CHECKPOINTS};
    longopts[OPT_COUNT + 2] = (struct option){"help", no_argument, NULL, LONG_HELP};
    longopts[OPT_COUNT + 3] = (struct option){"version", no_argument, NULL, LONG_VERSION};
    longopts[OPT_COUNT + 4] = (struct option){0};
    /* "-": other arguments come back in order (as 1), so the error reported is the first in the
       line; ":": a missing value comes back as ':'. Messages are ampc-train's own (opterr = 0) and
       keep today's rules: exact names, "-h" only alone, "--" is no end of options but an unknown
       one. optind = 0 makes glibc start over (the fuzz harness parses many lines). */
    opterr = 0;
    optind = 0;
    char canon[4096];
    for (;;) {
        int at = optind ? optind : 1;   /* the argument getopt_long reads next */
        int c = getopt_long(argc, argv, "-:h", longopts, NULL);
        if (c == -1) {
            if (at < argc && strcmp(argv[at], "--") == 0) return usage_error("unknown option '--'");
            return 0;
        }
        const char *arg = argv[at];
        if (c == 1 || (c == 'h' && strcmp(arg, "-h") != 0) || (c == '?' && strncmp(arg, "--", 2) != 0))
            return usage_error("unexpected argument '%s'", arg);
        if (c == 'h') return 1;
        size_t len;
        const struct option *o = exact_option(longopts, arg, &len);
        char hint[256];
        if (!o) return usage_error("unknown option '%.*s'%s", (int)(len + 2), arg, did_you_mean(longopts, arg + 2, len, hint, sizeof hint));
        if (c == '?') return usage_error("unknown option '%.*s'", (int)(len + 2), arg);
        if (c == ':') return usage_error("--%s needs a value (%s)", o->name, OPTS[o->val - 256].metavar);
        if (c == LONG_HELP) return 1;
        if (c == LONG_VERSION) return 2;
        if (c == LONG_COMPARE) {
            s->compare = true;
        } else if (c == LONG_COMPARE_CHECKPOINTS) {   /* two values: getopt_long takes one at most */
            if (optind + 1 >= argc) return usage_error("--compare-checkpoints needs two files");
            *cmp_a = argv[optind];
            *cmp_b = argv[optind + 1];
            optind += 2;
        } else {
            int id = c - 256;
            if (s->given[id]) return usage_error("--%s given twice", OPTS[id].name);
            const char *val = optarg;
            if (!val && optind < argc && (!strcmp(argv[optind], "yes") || !strcmp(argv[optind], "no")))
                val = argv[optind++];   /* a bare flag's value after a space: "--sync-bn no" */
            else if (!val)
                val = "yes";
            char why[256];
            if (canonical(id, val, canon, sizeof canon, why, sizeof why) < 0) return usage_error("%s", why);
            if (set_val(s, id, canon) < 0) return -1;
            s->given[id] = true;
        }
    }
}

/* The settings that shape every run (always shown), then those that differ from their defaults
   (given on the command line, or a resumed checkpoint's); --help lists every default. */
void print_config(const settings *s, const char *data_desc, bool use_amp) {
    static const int always[] = {OPT_MODEL, OPT_DATA, OPT_BATCH_SIZE, OPT_EPOCHS, OPT_USE_AMP,
                                 OPT_AMP_DTYPE, OPT_GRAD_SCALER, OPT_LR, OPT_DEVICE};
    char b1[32], b2[32], b3[64], def[256], err[128];
    printf("configuration (the defaults of the rest: --help):\n");
    for (int i = 0; i < OPT_COUNT; i++) {
        if (i == OPT_PROGRESS) continue;
        bool shown = false;
        for (size_t k = 0; k < sizeof always / sizeof *always; k++) shown = shown || always[k] == i;
        if ((i == OPT_AMP_DTYPE || i == OPT_GRAD_SCALER) && !use_amp) shown = false;   /* do not apply */
        if (!strcmp(s->val[OPT_MODEL], "gpt") && (i == OPT_BLOCK_SIZE || i == OPT_N_LAYER || i == OPT_N_HEAD || i == OPT_N_EMBD))
            shown = true;   /* the language model's shape */
        if (!shown && (OPTS[i].flags & O_AUTO) && !s->given[i]) continue;   /* resolved from "auto" by the data and model */
        if (!shown && (canonical(i, OPTS[i].def, def, sizeof def, err, sizeof err) < 0 || strcmp(def, s->val[i]) == 0)) continue;
        const char *v = s->val[i];
        if (i == OPT_DATA) v = data_desc;
        if (i == OPT_RESUME && !*v) v = "no";
        if (i == OPT_MAX_MEMORY && strcmp(v, "none") != 0) {
            snprintf(b3, sizeof b3, "%s (%s bytes)", fmt_bytes(strtod(v, NULL), b1, sizeof b1), fmt_count(ival(s, i), b2, sizeof b2));
            v = b3;
        }
        const char *note = "";
        if (i == OPT_MOMENTUM && strcmp(sval(s, OPT_OPTIMIZER), "sgd") != 0) note = "  (unused: not sgd)";
        if (i == OPT_AMP_DTYPE && !use_amp) note = "  (unused: --use-amp no)";
        if ((i == OPT_LIMIT_TRAIN || i == OPT_LIMIT_VAL) && ival(s, i) == 0) v = "all";
        printf("  %-14s %s%s\n", OPTS[i].name, v, note);
    }
}
