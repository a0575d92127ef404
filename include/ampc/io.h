/*
 * ampc/io.h - checkpoints (safetensors), metrics logs and plots (included by ampc.h).
 */
#ifndef AMPC_IO_H
#define AMPC_IO_H

#endif /* AMPC_IO_H */
