/*
 * fuzz_checkpoint_meta.c - ampc_checkpoint_meta_get on any text (src/io/safetensors.c): the
 * metadata JSON a caller may keep and parse later, without the file around it.
 *
 * Input: "KEY\nJSON" when a newline comes in the first 64 bytes, else the whole input is the
 * JSON and the key is "epoch". Text after a NUL byte is not seen (the API takes a C string).
 */
#include "fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_begin();
    char *text = malloc(size + 1);
    if (!text) return 0;
    memcpy(text, data, size);
    text[size] = '\0';
    const char *key = "epoch", *json = text;
    char *nl = memchr(text, '\n', size < 64 ? size : 64);
    if (nl) {
        *nl = '\0';
        key = text;
        json = nl + 1;
    }
    char buf[16];
    int len = ampc_checkpoint_meta_get(json, key, buf, sizeof buf);
    fuzz_report("meta_get", len >= 0);
    if (len >= 0 && strlen(buf) != (size_t)(len < (int)sizeof buf ? len : (int)sizeof buf - 1)) abort();
    if (len < 0 && !ampc_last_error()[0]) abort();   /* a failure must say why */
    int len2 = ampc_checkpoint_meta_get(json, key, NULL, 0);
    if (len2 != len) abort();   /* the length does not depend on the buffer */
    free(text);
    return 0;
}
