/*
 * folder.c - the image-folder dataset (Caltech-256, torchvision's ImageFolder layout):
 * root/<class>/.../<image>.{jpg,jpeg,png}, decoded on demand in get() and resized to one size.
 *
 * Scanning follows torchvision's ImageFolder rules: classes are the subfolders of root sorted
 * by name (byte order, like Python's sorted), labels their positions; each class folder is
 * walked recursively, its folders in sorted path order and the files of each sorted by name.
 * Differences, deliberate: names starting with '.' (files and folders) are skipped; only .jpg,
 * .jpeg and .png (any case) are candidates; walks stop 16 folders deep.
 *
 * Links: a symlink to an image file is followed. Each folder (by st_dev/st_ino) is taken once,
 * so samples are never duplicated and link loops end: all real folders are walked first (class
 * by class, sorted), then links to folders in the order met; a link to a folder already taken
 * (`ln -s . cat/again`, `ln -s .. cat/up`, a link into another class) is skipped silently. A
 * link to a folder (class folders included) must resolve inside the root's realpath: one that
 * leaves it is an error naming the link and its target, never a silent walk of outside files.
 *
 * Bad files: every candidate's header is checked at scan time (cheap: no pixels are decoded).
 * One that is not a readable JPEG/PNG (a text file named x.jpg, a file cut inside its header,
 * an image over 16384 pixels a side, a FIFO or device named x.png, which is never opened) is
 * skipped with one line on stderr naming it, and counted (ampc_dataset_folder_skipped). A file
 * that passes the header check but fails to decode later (cut in its pixel data) makes get()
 * return AMPC_ERR_FORMAT naming it; the loader surfaces it. A class folder left without images
 * is an error, as in torchvision.
 *
 * Index CSV (the usual preprocess step, and a cache of the scan): a header `image_path,target`
 * and one row per image, paths relative to root ('/'-separated; absolute ones must lie under the
 * root, as given or its real path; no '..' component: a row never leaves the root), RFC 4180
 * quoting. Given an index path that exists, open reads it instead of scanning
 * (no header checks); otherwise it scans and writes it (to a temporary name, then renamed, so
 * an interrupted write never leaves a partial index). Class names from an index are the first
 * path component of the first row of each target. Targets are class indices: digits, at most
 * 65535, and dense (the largest below 2 * distinct + 16), so a stray id like 999999 is an error
 * naming its line rather than a million-class model.
 *
 * Classes left out (exclude_classes, e.g. Caltech-256's clutter): matched by name before the
 * walk, so their folders are never read (nor written to the index); the rest are labelled 0..K-1
 * in their order. From an index, the rows of the classes matched by name are dropped and the
 * targets renumbered so; a pattern matching nothing there is no error (the index may have been
 * written with those classes left out already).
 */
#include "data/data.h"
#include "data/image.h"

#include <dirent.h>
#include <errno.h>
#include <fnmatch.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_DEPTH 16
#define MAX_TARGET 65535   /* largest class index an index CSV may give */

typedef struct {
    char **paths;        /* (size) full paths: root/relative, or absolute ones from an index */
    int64_t *targets;    /* (size) */
    int64_t skipped;     /* candidates refused by the header check at scan time */
    int64_t excluded;    /* classes left out by exclude_classes */
} folder_impl;

// ---------------------------------------------------------------------------------------------
// Growing arrays of strings and labels

typedef struct {
    char **strs;
    int64_t *tags;       /* an integer per string: the class label in an index, a flag or mode in a scan */
    int64_t n, cap;
} list;

static void list_free(list *l) {
    for (int64_t i = 0; i < l->n; i++) free(l->strs[i]);
    free(l->strs);
    free(l->tags);
    *l = (list){0};
}

/* Appends s (taken over: freed on failure too) with tag t. */
static int list_push(list *l, char *s, int64_t t) {
    if (!s) return ampc__err(AMPC_ERR_OOM, "image folder: out of memory");
    if (l->n == l->cap) {
        int64_t cap = l->cap ? 2 * l->cap : 64;
        char **v = realloc(l->strs, (size_t)cap * sizeof *v);
        if (v) l->strs = v;
        int64_t *tt = v ? realloc(l->tags, (size_t)cap * sizeof *tt) : NULL;
        if (tt) l->tags = tt;
        if (!v || !tt) {
            free(s);
            return ampc__err(AMPC_ERR_OOM, "image folder: out of memory for %lld entries", (long long)cap);
        }
        l->cap = cap;
    }
    l->strs[l->n] = s;
    l->tags[l->n++] = t;
    return 0;
}

typedef struct { char *str; int64_t tag; } entry;

static int cmp_entry(const void *a, const void *b) { return strcmp(((const entry *)a)->str, ((const entry *)b)->str); }

/* Sorts the strings by bytes (Python's sorted()), each keeping its label. */
static int list_sort(list *l) {
    if (l->n < 2) return 0;
    entry *e = malloc((size_t)l->n * sizeof *e);
    if (!e) return ampc__err(AMPC_ERR_OOM, "image folder: out of memory");
    for (int64_t i = 0; i < l->n; i++) e[i] = (entry){l->strs[i], l->tags[i]};
    qsort(e, (size_t)l->n, sizeof *e, cmp_entry);
    for (int64_t i = 0; i < l->n; i++) l->strs[i] = e[i].str, l->tags[i] = e[i].tag;
    free(e);
    return 0;
}

/* "a/b" from a and b (either may be empty); malloc'd, NULL when out of memory. */
static char *join(const char *a, const char *b) {
    if (!*a) return strdup(b);
    if (!*b) return strdup(a);
    size_t na = strlen(a), nb = strlen(b);
    char *s = malloc(na + nb + 2);
    if (!s) return NULL;
    memcpy(s, a, na);
    s[na] = '/';
    memcpy(s + na + 1, b, nb + 1);
    return s;
}

// ---------------------------------------------------------------------------------------------
// Scanning

static bool is_image_name(const char *name) {
    const char *dot = strrchr(name, '.');
    return dot && (!strcasecmp(dot, ".jpg") || !strcasecmp(dot, ".jpeg") || !strcasecmp(dot, ".png"));
}

/* The visible entries of dir, split into folders and files (names, each list sorted). A folder's
   label is 1 when the entry is a symlink to it; a file's is its st_mode after following links (0
   for a dangling link, which counts as a file: its check then fails). Nothing is opened. */
static int list_dir(const char *dir, list *dirs, list *files) {
    char eb[128];
    DIR *d = opendir(dir);
    if (!d) return ampc__err(AMPC_ERR_IO, "image folder: %s: %s", dir, strerror_r(errno, eb, sizeof eb));
    struct dirent *e;
    int rc = 0;
    while (rc == 0 && (errno = 0, e = readdir(d))) {
        if (e->d_name[0] == '.') continue;   /* hidden, and . and .. */
        char *full = join(dir, e->d_name);
        if (!full) {
            rc = ampc__err(AMPC_ERR_OOM, "image folder: out of memory");
            break;
        }
        struct stat st;
        bool ok = lstat(full, &st) == 0, link = ok && S_ISLNK(st.st_mode);
        if (link) ok = stat(full, &st) == 0;
        free(full);
        if (ok && S_ISDIR(st.st_mode)) rc = list_push(dirs, strdup(e->d_name), link);
        else rc = list_push(files, strdup(e->d_name), ok ? (int64_t)st.st_mode : 0);
    }
    if (rc == 0 && errno) rc = ampc__err(AMPC_ERR_IO, "image folder: reading %s: %s", dir, strerror_r(errno, eb, sizeof eb));
    closedir(d);
    if (rc == 0) rc = list_sort(dirs);
    if (rc == 0) rc = list_sort(files);
    return rc;
}

/* The folders taken so far, by (st_dev, st_ino): an open-addressing hash set. */
typedef struct {
    struct { uint64_t dev, ino; bool used; } *slots;
    size_t n, cap;   /* cap: 0 or a power of two, at least twice n */
} dir_set;

static size_t dir_hash(uint64_t dev, uint64_t ino, size_t cap) {
    uint64_t h = (ino ^ dev << 32 ^ dev >> 32) * 0x9E3779B97F4A7C15u;
    return (size_t)(h >> 17) & (cap - 1);
}

/* 1: added, 0: already there, < 0: out of memory. */
static int dir_set_add(dir_set *s, const struct stat *st) {
    if (2 * (s->n + 1) > s->cap) {
        dir_set g = {calloc(s->cap ? 2 * s->cap : 64, sizeof *s->slots), s->n, s->cap ? 2 * s->cap : 64};
        if (!g.slots) return ampc__err(AMPC_ERR_OOM, "image folder: out of memory");
        for (size_t i = 0; i < s->cap; i++) {
            if (!s->slots[i].used) continue;
            size_t h = dir_hash(s->slots[i].dev, s->slots[i].ino, g.cap);
            while (g.slots[h].used) h = (h + 1) & (g.cap - 1);
            g.slots[h] = s->slots[i];
        }
        free(s->slots);
        *s = g;
    }
    uint64_t dev = (uint64_t)st->st_dev, ino = (uint64_t)st->st_ino;
    size_t h = dir_hash(dev, ino, s->cap);
    for (; s->slots[h].used; h = (h + 1) & (s->cap - 1))
        if (s->slots[h].dev == dev && s->slots[h].ino == ino) return 0;
    s->slots[h].dev = dev;
    s->slots[h].ino = ino;
    s->slots[h].used = true;
    s->n++;
    return 1;
}

/* The walk of every class folder (see the file comment for its rules). */
typedef struct {
    const char *root;
    char *root_real;   /* realpath(root): links to folders must resolve inside it */
    dir_set seen;      /* every folder taken, the root included */
    list *dirs;        /* (classes) each class's folders, paths relative to root */
    list links;        /* links to folders met by the walk (relative path, class), followed last */
} walk;

static int walk_dir(walk *w, const char *rel, int64_t cls, int depth);

static bool path_inside(const char *p, const char *root) {
    size_t n = strlen(root);
    if (n == 1) return true;   /* the root is "/" */
    return !strncmp(p, root, n) && (p[n] == 0 || p[n] == '/');
}

/* Takes folder root/rel (depth components deep) for class cls unless it was taken already: 1
   taken, 0 skipped, < 0 error. A link must resolve inside the root. */
static int enter(walk *w, const char *rel, int64_t cls, int depth, bool is_link) {
    char eb[128];
    char *full = join(w->root, rel), *real = NULL;
    if (!full) return ampc__err(AMPC_ERR_OOM, "image folder: out of memory");
    struct stat st;
    int rc = 0;
    if (is_link && !(real = realpath(full, NULL)))
        rc = ampc__err(AMPC_ERR_IO, "image folder %s: link '%s': %s", w->root, rel, strerror_r(errno, eb, sizeof eb));
    else if (is_link && !path_inside(real, w->root_real))
        rc = ampc__err(AMPC_ERR_FORMAT, "image folder %s: link '%s' points to '%s', which leaves the dataset root '%s' "
                       "(copy the folder in, or make the link point inside the root)", w->root, full, real, w->root_real);
    else if (stat(full, &st) != 0)
        rc = ampc__err(AMPC_ERR_IO, "image folder %s: %s: %s", w->root, rel, strerror_r(errno, eb, sizeof eb));
    else
        rc = dir_set_add(&w->seen, &st);
    free(real);
    free(full);
    if (rc <= 0) return rc;
    rc = walk_dir(w, rel, cls, depth);
    return rc < 0 ? rc : 1;
}

/* Adds root/rel, just taken, to class cls's folders, then the real folders under it, at most
   MAX_DEPTH deep; links to folders are set aside in w->links. */
static int walk_dir(walk *w, const char *rel, int64_t cls, int depth) {
    int rc = list_push(&w->dirs[cls], strdup(rel), 0);
    if (rc < 0 || depth >= MAX_DEPTH) return rc;
    char *full = join(w->root, rel);
    if (!full) return ampc__err(AMPC_ERR_OOM, "image folder: out of memory");
    list dirs = {0}, files = {0};
    rc = list_dir(full, &dirs, &files);
    free(full);
    for (int64_t i = 0; rc == 0 && i < dirs.n; i++) {
        char *sub = join(rel, dirs.strs[i]);
        if (dirs.tags[i]) {
            rc = list_push(&w->links, sub, cls);   /* takes sub over */
        } else {
            rc = sub ? enter(w, sub, cls, depth + 1, false) : ampc__err(AMPC_ERR_OOM, "image folder: out of memory");
            rc = rc < 0 ? rc : 0;
            free(sub);
        }
    }
    list_free(&dirs);
    list_free(&files);
    return rc;
}

/* Appends the images in class cls's folders (relative paths) to idx with label target. */
static int scan_class(const char *root, const char *cls, int64_t target, list *dirs, list *idx, int64_t *skipped) {
    /* torchvision walks sorted(os.walk(...)): folders in the byte order of their whole paths */
    int rc = list_sort(dirs);
    int64_t found = 0;
    for (int64_t i = 0; rc == 0 && i < dirs->n; i++) {
        list sub = {0}, files = {0};
        char *full = join(root, dirs->strs[i]);
        rc = full ? list_dir(full, &sub, &files) : ampc__err(AMPC_ERR_OOM, "image folder: out of memory");
        for (int64_t k = 0; rc == 0 && k < files.n; k++) {
            if (!is_image_name(files.strs[k])) continue;
            char *path = join(full, files.strs[k]);
            if (!path) {
                rc = ampc__err(AMPC_ERR_OOM, "image folder: out of memory");
                break;
            }
            unsigned mode = (unsigned)files.tags[k];
            int prc = mode && !S_ISREG(mode)   /* a FIFO would block the probe: not opened at all */
                          ? ampc__err(AMPC_ERR_IO, "%s: %s, not a regular file", path, ampc__file_type_name(mode))
                          : ampc__image_probe_file(path, NULL, NULL);
            free(path);
            if (prc == AMPC_ERR_FORMAT || prc == AMPC_ERR_IO) {
                /* the message without its "<status text>: " prefix names the file */
                const char *why = ampc_last_error() + strlen(ampc_strerror(prc)) + 2;
                fprintf(stderr, "ampc: image folder: skipping %s\n", why);
                ampc_clear_error();
                (*skipped)++;
            } else if (prc < 0) {
                rc = prc;
            } else {
                rc = list_push(idx, join(dirs->strs[i], files.strs[k]), target);
                found++;
            }
        }
        free(full);
        list_free(&sub);
        list_free(&files);
    }
    if (rc == 0 && found == 0)
        rc = ampc__err(AMPC_ERR_FORMAT, "image folder %s: class folder '%s' has no readable .jpg/.jpeg/.png image", root,
                       cls);
    return rc;
}

static int depth_of(const char *rel) {
    int d = 1;
    for (; *rel; rel++) d += *rel == '/';
    return d;
}

// ---------------------------------------------------------------------------------------------
// Classes left out (ampc_folder_options.exclude_classes)

typedef struct {
    ampc_patterns p;
    bool used[AMPC_MAX_PATTERNS];
} exclusion;

/* A class matches a pattern by fnmatch(3) on its name or, for Caltech's numbered names
   ("257.clutter"), on the part after the number and its dot. */
static bool exclusion_match(exclusion *e, const char *name) {
    if (!name) return false;
    const char *bare = name;
    while (*bare >= '0' && *bare <= '9') bare++;
    bare = bare > name && *bare == '.' ? bare + 1 : NULL;
    bool hit = false;
    for (int k = 0; k < e->p.n; k++)
        if (fnmatch(e->p.pat[k], name, 0) == 0 || (bare && fnmatch(e->p.pat[k], bare, 0) == 0)) hit = e->used[k] = true;
    return hit;
}

/* Leaves out the classes matching `patterns`: their entries in classes (the rest keep their
   order) and, given idx, their rows, renumbering the labels of the rest 0..K-1. Patterns that
   leave no class are an error, and so is one that matches none when the classes come from a
   scan (an index may have been written with them left out already). */
static int exclude_classes(const char *root, const char *patterns, list *classes, list *idx, int64_t *n_excluded) {
    exclusion e = {0};
    char who[300];
    snprintf(who, sizeof who, "image folder %s: exclude_classes", root);
    if (!*patterns) return ampc__err(AMPC_ERR_INVALID, "%s '' has an empty pattern", who);   /* NULL is none */
    int rc = ampc__patterns_parse(&e.p, patterns, AMPC_MAX_PATTERNS, who);
    if (rc < 0) return rc;
    int64_t *map = malloc((size_t)(classes->n ? classes->n : 1) * sizeof *map), kept = 0;
    if (!map) {
        ampc__patterns_free(&e.p);
        return ampc__err(AMPC_ERR_OOM, "image folder: out of memory");
    }
    for (int64_t c = 0; c < classes->n; c++) map[c] = exclusion_match(&e, classes->strs[c]) ? -1 : kept++;
    for (int k = 0; rc == 0 && !idx && k < e.p.n; k++)
        if (!e.used[k]) rc = ampc__err(AMPC_ERR_INVALID, "image folder %s: exclude pattern '%s' matches no class", root, e.p.pat[k]);
    if (rc == 0 && kept == 0) rc = ampc__err(AMPC_ERR_INVALID, "image folder %s: exclude_classes '%s' leaves no class", root, patterns);
    if (rc == 0) {
        *n_excluded = classes->n - kept;
        for (int64_t c = 0; c < classes->n; c++) {
            if (map[c] < 0) {
                free(classes->strs[c]);
                continue;
            }
            classes->strs[map[c]] = classes->strs[c];
            if (classes->tags) classes->tags[map[c]] = classes->tags[c];   /* an index's classes have none */
        }
        classes->n = kept;
        int64_t n = 0;
        for (int64_t i = 0; idx && i < idx->n; i++) {
            int64_t t = idx->tags[i];
            if (map[t] < 0) {
                free(idx->strs[i]);
                continue;
            }
            idx->strs[n] = idx->strs[i];
            idx->tags[n++] = map[t];
        }
        if (idx) idx->n = n;
    }
    free(map);
    ampc__patterns_free(&e.p);
    return rc;
}

static int scan(const char *root, const char *exclude, list *classes, list *idx, int64_t *skipped, int64_t *excluded) {
    char eb[128];
    walk w = {.root = root};
    list files = {0};
    struct stat st;
    int rc = list_dir(root, classes, &files);
    list_free(&files);   /* files directly under root belong to no class */
    if (rc == 0 && classes->n == 0)
        rc = ampc__err(AMPC_ERR_FORMAT, "image folder %s: no class folders (expected root/<class>/<image>)", root);
    if (rc == 0 && exclude) rc = exclude_classes(root, exclude, classes, NULL, excluded);   /* never walked */
    if (rc == 0 && (!(w.root_real = realpath(root, NULL)) || stat(root, &st) != 0))
        rc = ampc__err(AMPC_ERR_IO, "image folder %s: %s", root, strerror_r(errno, eb, sizeof eb));
    if (rc == 0) rc = dir_set_add(&w.seen, &st) < 0 ? AMPC_ERR_OOM : 0;   /* a link back to the root is skipped */
    if (rc == 0 && !(w.dirs = calloc((size_t)classes->n, sizeof *w.dirs)))
        rc = ampc__err(AMPC_ERR_OOM, "image folder: out of memory");
    /* Real folders first (class folders that are links after the others), links to folders last:
       a folder reachable without links is never taken through one. */
    for (int link = 0; link < 2; link++)
        for (int64_t c = 0; rc == 0 && c < classes->n; c++) {
            if (classes->tags[c] != link) continue;
            rc = enter(&w, classes->strs[c], c, 1, link);
            if (rc == 0)
                rc = ampc__err(AMPC_ERR_FORMAT, "image folder %s: class folder '%s' is a link to a folder already scanned",
                               root, classes->strs[c]);
            else if (rc > 0)
                rc = 0;
        }
    for (int64_t i = 0; rc >= 0 && i < w.links.n; i++) {
        const char *rel = w.links.strs[i];   /* the list may grow: the string stays */
        rc = enter(&w, rel, w.links.tags[i], depth_of(rel), true);
    }
    if (rc > 0) rc = 0;
    for (int64_t c = 0; rc == 0 && c < classes->n; c++) rc = scan_class(root, classes->strs[c], c, &w.dirs[c], idx, skipped);
    for (int64_t c = 0; w.dirs && c < classes->n; c++) list_free(&w.dirs[c]);
    free(w.dirs);
    list_free(&w.links);
    free(w.seen.slots);
    free(w.root_real);
    if (rc == 0 && *skipped > 0)
        fprintf(stderr, "ampc: image folder %s: skipped %lld file(s) that are not readable JPEG/PNG images\n", root,
                (long long)*skipped);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Index CSV

static void csv_field(FILE *f, const char *s) {
    if (!strpbrk(s, ",\"\r\n")) {
        fputs(s, f);
        return;
    }
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"') fputc('"', f);
        fputc(*s, f);
    }
    fputc('"', f);
}

static int write_index(const char *csv, const list *idx) {
    char eb[128];
    size_t n = strlen(csv) + 32;
    char *tmp = malloc(n);
    if (!tmp) return ampc__err(AMPC_ERR_OOM, "image folder: out of memory");
    snprintf(tmp, n, "%s.tmp.%ld", csv, (long)getpid());
    ampc__remove_stale_temps(csv);
    unlink(tmp);   /* "wx": a new file, never a FIFO or link placed there */
    FILE *f = fopen(tmp, "wx");
    if (!f) {
        int rc = ampc__err(AMPC_ERR_IO, "image folder index %s: %s", tmp, strerror_r(errno, eb, sizeof eb));
        free(tmp);
        return rc;
    }
    fputs("image_path,target\n", f);
    for (int64_t i = 0; i < idx->n; i++) {
        csv_field(f, idx->strs[i]);
        fprintf(f, ",%lld\n", (long long)idx->tags[i]);
    }
    bool bad = ferror(f) != 0;
    int e = errno;
    if (fclose(f) != 0 && !bad) {
        bad = true;
        e = errno;
    }
    int rc = 0;
    if (bad) {
        rc = ampc__err(AMPC_ERR_IO, "image folder index %s: write failed: %s", tmp, strerror_r(e, eb, sizeof eb));
        remove(tmp);
    } else if (rename(tmp, csv) != 0) {
        rc = ampc__err(AMPC_ERR_IO, "image folder index: renaming %s to %s: %s", tmp, csv, strerror_r(errno, eb, sizeof eb));
        remove(tmp);
    }
    free(tmp);
    return rc;
}

typedef struct {
    const char *p, *name;
    size_t n, pos;
    int64_t line;   /* of the next character */
} csv_reader;

typedef struct { char *s; size_t n, cap; } strbuf;

static bool sb_put(strbuf *b, char c) {
    if (b->n + 1 >= b->cap) {
        size_t cap = b->cap ? 2 * b->cap : 64;
        char *s = realloc(b->s, cap);
        if (!s) return false;
        b->s = s;
        b->cap = cap;
    }
    b->s[b->n++] = c;
    b->s[b->n] = 0;
    return true;
}

/* One record: its first `max` fields into fields[] (malloc'd), *nf = how many it has, *line =
   the line it starts on. 1: a record, 0: end of input, < 0: error naming the line. */
/* On an error inside a record: the fields already read are freed (the caller gets none). */
static void csv_drop(char **fields, int *nf, int max) {
    for (int i = 0; i < *nf && i < max; i++) free(fields[i]);
    *nf = 0;
}

static int csv_record(csv_reader *r, char **fields, int max, int *nf, int64_t *line) {
    if (r->pos >= r->n) return 0;
    const char *p = r->p;
    *nf = 0;
    *line = r->line;
    for (;;) {
        strbuf b = {0};
        if (!sb_put(&b, 0)) {
            csv_drop(fields, nf, max);
            return ampc__err(AMPC_ERR_OOM, "image folder index: out of memory");
        }
        b.n = 0;
        bool ok = true;
        if (r->pos < r->n && p[r->pos] == '"') {
            r->pos++;
            for (;;) {
                if (r->pos >= r->n) {
                    free(b.s);
                    csv_drop(fields, nf, max);
                    return ampc__err(AMPC_ERR_FORMAT, "image folder index %s:%lld: unterminated quoted field", r->name,
                                     (long long)*line);
                }
                char ch = p[r->pos++];
                if (ch == '"') {
                    if (r->pos < r->n && p[r->pos] == '"') r->pos++;
                    else break;
                }
                if (ch == '\n') r->line++;
                ok = ok && sb_put(&b, ch);
            }
            if (r->pos < r->n && p[r->pos] != ',' && p[r->pos] != '\n' && p[r->pos] != '\r') {
                free(b.s);
                csv_drop(fields, nf, max);
                return ampc__err(AMPC_ERR_FORMAT, "image folder index %s:%lld: text after a closing quote", r->name,
                                 (long long)*line);
            }
        } else {
            for (; r->pos < r->n && p[r->pos] != ',' && p[r->pos] != '\n' && p[r->pos] != '\r'; r->pos++) {
                if (p[r->pos] == '"') {
                    free(b.s);
                    csv_drop(fields, nf, max);
                    return ampc__err(AMPC_ERR_FORMAT, "image folder index %s:%lld: quote inside an unquoted field "
                                     "(quote the whole field)", r->name, (long long)*line);
                }
                ok = ok && sb_put(&b, p[r->pos]);
            }
        }
        if (!ok) {
            free(b.s);
            csv_drop(fields, nf, max);
            return ampc__err(AMPC_ERR_OOM, "image folder index: out of memory");
        }
        if (*nf < max) fields[*nf] = b.s;
        else free(b.s);
        (*nf)++;
        if (r->pos < r->n && p[r->pos] == ',') {
            r->pos++;
            continue;
        }
        if (r->pos < r->n && p[r->pos] == '\r') r->pos++;
        if (r->pos < r->n && p[r->pos] == '\n') r->pos++;
        r->line++;
        return 1;
    }
}

static void free_fields(char **f, int nf, int max) {
    for (int i = 0; i < nf && i < max; i++) free(f[i]);
}

/* A target: decimal digits only, at most MAX_TARGET; -1 otherwise. */
static int64_t parse_target(const char *s) {
    int64_t t = 0;
    if (!*s) return -1;
    for (; *s; s++) {
        if (*s < '0' || *s > '9') return -1;
        t = 10 * t + (*s - '0');
        if (t > MAX_TARGET) return -1;
    }
    return t;
}

/* Is index row p inside root (root_real: its real path)? No ".." component, and an absolute path
   only under the root. Lexical: rows are many, and a link inside the root is the user's own. */
static bool row_inside(const char *p, const char *root, const char *root_real) {
    for (const char *c = p; *c; c = strchr(c, '/') ? strchr(c, '/') + 1 : c + strlen(c))
        if (c[0] == '.' && c[1] == '.' && (c[2] == '/' || c[2] == 0)) return false;
    if (p[0] != '/') return true;
    size_t n = strlen(root);
    while (n > 1 && root[n - 1] == '/') n--;   /* "img/" as "img" */
    bool under_root = root[0] == '/' && (n == 1 || (!strncmp(p, root, n) && p[n] == '/'));
    return under_root || (root_real && path_inside(p, root_real) && strcmp(p, root_real) != 0);
}

/* Reads the index into idx (paths as written, labels); a row that leaves root is refused. */
static int read_index(const char *csv, const char *root, list *idx) {
    char eb[128];
    struct stat st;
    FILE *fp = ampc__fopen_regular(csv, "image folder index", &st);   /* a FIFO would block */
    if (!fp) return ampc_last_status();
    size_t n = (size_t)st.st_size;
    char what[4200];
    snprintf(what, sizeof what, "image folder index %s (read whole)", csv);
    int fits = ampc__memory_fits((uint64_t)n + 1, what, 0, NULL);
    if (fits < 0) {
        fclose(fp);
        return fits;
    }
    char *buf = malloc(n + 1);
    size_t got = buf ? fread(buf, 1, n, fp) : 0;
    int e = errno;
    fclose(fp);
    if (!buf) return ampc__err(AMPC_ERR_OOM, "image folder index %s: %zu bytes", csv, n);
    if (got != n) {
        free(buf);
        return ampc__err(AMPC_ERR_IO, "image folder index %s: read failed: %s", csv, strerror_r(e, eb, sizeof eb));
    }
    const char *nul = memchr(buf, 0, n);
    if (nul) {
        int64_t at = 1;
        for (const char *c = buf; c < nul; c++) at += *c == '\n';
        free(buf);
        return ampc__err(AMPC_ERR_FORMAT, "image folder index %s:%lld: a NUL byte: not a CSV text file", csv, (long long)at);
    }
    char *root_real = realpath(root, NULL);   /* NULL (out of memory): rows under root as given only */
    csv_reader r = {.p = buf, .name = csv, .n = n, .line = 1};
    uint8_t used[(MAX_TARGET + 1) / 8] = {0};   /* bit t: some row has target t */
    int64_t distinct = 0, max_t = -1, max_line = 0;
    if (n >= 3 && !memcmp(buf, "\xEF\xBB\xBF", 3)) r.pos = 3;   /* UTF-8 byte order mark */
    char *f[2];
    int nf, rc;
    int64_t line;
    rc = csv_record(&r, f, 2, &nf, &line);
    if (rc == 0) rc = ampc__err(AMPC_ERR_FORMAT, "image folder index %s: empty file (expected a header image_path,target)", csv);
    if (rc > 0) {
        bool ok = nf == 2 && !strcmp(f[0], "image_path") && !strcmp(f[1], "target");
        free_fields(f, nf, 2);
        rc = ok ? 0 : ampc__err(AMPC_ERR_FORMAT, "image folder index %s:%lld: the header must be image_path,target", csv,
                                (long long)line);
    }
    while (rc == 0 && (rc = csv_record(&r, f, 2, &nf, &line)) > 0) {
        rc = 0;
        if (nf == 1 && !f[0][0]) {   /* blank line */
            free(f[0]);
            continue;
        }
        int64_t t = nf == 2 ? parse_target(f[1]) : -1;
        if (nf != 2)
            rc = ampc__err(AMPC_ERR_FORMAT, "image folder index %s:%lld: expected 2 fields (image_path,target), found %d",
                           csv, (long long)line, nf);
        else if (!f[0][0])
            rc = ampc__err(AMPC_ERR_FORMAT, "image folder index %s:%lld: empty image_path", csv, (long long)line);
        else if (!row_inside(f[0], root, root_real))
            rc = ampc__err(AMPC_ERR_FORMAT, "image folder index %s:%lld: image_path '%s' leaves the dataset root '%s' (rows are "
                           "paths inside it: no '..', absolute ones under it)", csv, (long long)line, f[0], root);
        else if (t < 0)
            rc = ampc__err(AMPC_ERR_FORMAT, "image folder index %s:%lld: target '%s' is not an integer in [0, %d]", csv,
                           (long long)line, f[1], MAX_TARGET);
        else {
            rc = list_push(idx, f[0], t);
            f[0] = NULL;   /* taken over */
            if (!(used[t / 8] & 1u << t % 8)) distinct++;
            used[t / 8] |= (uint8_t)(1u << t % 8);
            if (t > max_t) max_t = t, max_line = line;
        }
        free_fields(f, nf, 2);
    }
    /* A class index, not an id: target 999999 would make a million-class model. */
    if (rc == 0 && max_t >= 2 * distinct + 16)
        rc = ampc__err(AMPC_ERR_FORMAT, "image folder index %s:%lld: target %lld would make %lld classes for %lld distinct "
                       "targets: targets must be class indices 0..K-1 (renumber them)", csv, (long long)max_line,
                       (long long)max_t, (long long)max_t + 1, (long long)distinct);
    free(buf);
    free(root_real);
    if (rc == 0 && idx->n == 0) rc = ampc__err(AMPC_ERR_FORMAT, "image folder index %s: no rows", csv);
    return rc;
}

/* Class names of an index: the first path component of each target's first row (NULL if a
   target has no rows or its path has no folder). */
static int index_classes(const list *idx, list *classes) {
    int64_t k = 0;
    for (int64_t i = 0; i < idx->n; i++)
        if (idx->tags[i] + 1 > k) k = idx->tags[i] + 1;
    if (!(classes->strs = calloc((size_t)k, sizeof *classes->strs)))
        return ampc__err(AMPC_ERR_OOM, "image folder: out of memory for %lld classes", (long long)k);
    classes->n = classes->cap = k;
    for (int64_t i = 0; i < idx->n; i++) {
        const char *p = idx->strs[i], *slash = strchr(p, '/');
        int64_t t = idx->tags[i];
        if (classes->strs[t] || !slash || p[0] == '/') continue;
        if (!(classes->strs[t] = strndup(p, (size_t)(slash - p))))
            return ampc__err(AMPC_ERR_OOM, "image folder: out of memory");
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------
// The dataset

static int folder_get(ampc_dataset *ds, int64_t i, float *img, int64_t *label) {
    folder_impl *f = ds->impl;
    if (i < 0 || i >= ds->size)
        return ampc__err(AMPC_ERR_INVALID, "image folder: index %lld out of range [0, %lld)", (long long)i,
                         (long long)ds->size);
    ampc_image im;
    int rc = ampc__image_decode_file(f->paths[i], (int)ds->channels, &im);
    if (rc < 0) return rc;
    rc = ampc__image_resize_chw(&im, ds->height, ds->width, img);
    ampc__image_free(&im);
    if (rc < 0) return rc;
    *label = f->targets[i];
    return 0;
}

static void folder_free(ampc_dataset *ds) {
    folder_impl *f = ds->impl;
    if (!f) return;
    for (int64_t i = 0; i < ds->size; i++) free(f->paths[i]);
    free(f->paths);
    free(f->targets);
    free(f);
    ds->impl = NULL;
}

static const ampc_dataset_vtable folder_vt = {"folder", folder_get, folder_free, NULL};

static const folder_impl *as_folder(const ampc_dataset *ds, const char *fn) {
    if (ampc__dataset_stale(ds, fn)) return NULL;
    if (!ds || ds->vt != &folder_vt) return ampc__err_null(AMPC_ERR_INVALID, "%s: not an image-folder dataset", fn);
    return ds->impl;
}

int64_t ampc_dataset_folder_skipped(const ampc_dataset *ds) {
    const folder_impl *f = as_folder(ds, "ampc_dataset_folder_skipped");
    return f ? f->skipped : ampc_last_status();
}

int64_t ampc_dataset_folder_excluded(const ampc_dataset *ds) {
    const folder_impl *f = as_folder(ds, "ampc_dataset_folder_excluded");
    return f ? f->excluded : ampc_last_status();
}

const char *ampc_dataset_folder_path(const ampc_dataset *ds, int64_t i) {
    const folder_impl *f = as_folder(ds, "ampc_dataset_folder_path");
    if (!f) return NULL;
    if (i < 0 || i >= ds->size)
        return ampc__err_null(AMPC_ERR_INVALID, "ampc_dataset_folder_path: index %lld out of range [0, %lld)",
                              (long long)i, (long long)ds->size);
    return f->paths[i];
}

ampc_dataset *ampc_dataset_folder_open(const char *root, const ampc_folder_options *o) {
    char eb[128];
    if (!root || !o) return ampc__err_null(AMPC_ERR_INVALID, "ampc_dataset_folder_open: NULL root or options");
    int channels = o->channels ? o->channels : 3;
    if (o->height <= 0 || o->width <= 0 || o->height > AMPC_IMAGE_MAX_DIM || o->width > AMPC_IMAGE_MAX_DIM)
        return ampc__err_null(AMPC_ERR_INVALID, "image folder %s: height and width must be in [1, %d], not %lldx%lld",
                              root, AMPC_IMAGE_MAX_DIM, (long long)o->height, (long long)o->width);
    if (channels != 1 && channels != 3)
        return ampc__err_null(AMPC_ERR_INVALID, "image folder %s: channels must be 1 or 3, not %d", root, channels);
    struct stat st;
    if (stat(root, &st) != 0)
        return ampc__err_null(AMPC_ERR_IO, "image folder %s: %s", root, strerror_r(errno, eb, sizeof eb));
    if (!S_ISDIR(st.st_mode)) return ampc__err_null(AMPC_ERR_IO, "image folder %s: not a directory", root);

    list classes = {0}, idx = {0};
    int64_t skipped = 0, excluded = 0;
    int rc;
    bool have_index = false;
    if (o->index_csv) {
        if (stat(o->index_csv, &st) == 0) have_index = true;
        else if (errno != ENOENT)
            return ampc__err_null(AMPC_ERR_IO, "image folder index %s: %s", o->index_csv, strerror_r(errno, eb, sizeof eb));
    }
    if (have_index) {
        rc = read_index(o->index_csv, root, &idx);
        if (rc == 0) rc = index_classes(&idx, &classes);
        if (rc == 0 && o->exclude_classes) rc = exclude_classes(root, o->exclude_classes, &classes, &idx, &excluded);
    } else {
        rc = scan(root, o->exclude_classes, &classes, &idx, &skipped, &excluded);
        if (rc == 0 && o->index_csv) rc = write_index(o->index_csv, &idx);
    }

    folder_impl *f = rc == 0 ? calloc(1, sizeof *f) : NULL;
    ampc_dataset *ds = f ? ampc__dataset_alloc(&folder_vt) : NULL;
    if (rc == 0 && (!f || !ds)) rc = ampc__err(AMPC_ERR_OOM, "image folder: out of memory");
    if (rc == 0) {
        f->paths = calloc((size_t)idx.n, sizeof *f->paths);
        if (!f->paths) rc = ampc__err(AMPC_ERR_OOM, "image folder: out of memory");
    }
    for (int64_t i = 0; rc == 0 && i < idx.n; i++) {   /* full paths, so get() joins nothing */
        f->paths[i] = idx.strs[i][0] == '/' ? strdup(idx.strs[i]) : join(root, idx.strs[i]);
        if (!f->paths[i]) rc = ampc__err(AMPC_ERR_OOM, "image folder: out of memory");
    }
    if (rc == 0 && have_index && access(f->paths[0], R_OK) != 0)   /* catches a wrong root early */
        rc = ampc__err(AMPC_ERR_IO, "image folder index %s: first image %s: %s (is the root right?)", o->index_csv,
                       f->paths[0], strerror_r(errno, eb, sizeof eb));
    if (rc < 0) {
        if (f && f->paths)
            for (int64_t i = 0; i < idx.n; i++) free(f->paths[i]);
        if (f) free(f->paths);
        free(f);
        ampc__dataset_release(ds);
        list_free(&classes);
        list_free(&idx);
        return NULL;
    }
    f->targets = idx.tags;   /* taken over */
    f->skipped = skipped;
    f->excluded = excluded;
    idx.tags = NULL;
    ds->impl = f;
    ds->size = idx.n;
    ds->num_classes = classes.n;
    ds->channels = channels;
    ds->height = o->height;
    ds->width = o->width;
    /* the file list as scanned or indexed (relative to the root where it is) and the targets */
    ds->fingerprint = ampc__fnv(AMPC__FNV_START, f->targets, (size_t)idx.n * sizeof *f->targets);
    for (int64_t i = 0; i < idx.n; i++) ds->fingerprint = ampc__fnv(ds->fingerprint, idx.strs[i], strlen(idx.strs[i]) + 1);
    ds->class_names = classes.strs;   /* taken over; freed by ampc_dataset_free */
    classes.strs = NULL;
    classes.n = 0;
    list_free(&classes);
    list_free(&idx);
    return ds;
}
