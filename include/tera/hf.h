/* Hugging Face interchange: a Mixtral directory (config.json + model.safetensors, or shards with
 * model.safetensors.index.json). Options Mixtral cannot express use DeepSeek-V3 / Qwen-MoE names:
 *   model.layers.{l}.mlp.shared_experts.{gate,up,down}_proj.weight      shared experts
 *   model.layers.{l}.mlp.{gate,up,down}_proj.weight                     dense layers
 *   model.layers.{l}.block_sparse_moe.gate.e_score_correction_bias      aux-free bias (F32 [E])
 *   config.json: n_shared_experts, moe_intermediate_size, first_k_dense_replace, ... */
#ifndef TERA_HF_H
#define TERA_HF_H

#include "tera/model.h"

/* Writes config.json and the weights (sharded when max_shard_bytes > 0 and exceeded). The
 * directory is created if missing; an existing non-empty directory is refused unless overwrite. */
tera_status tera_hf_export(const tera_model *m, const char *dir, int64_t max_shard_bytes, int overwrite);
/* Reads config.json into cfg (fields not present keep their current value). */
tera_status tera_hf_read_config(const char *dir, tera_model_config *cfg);
/* Writes cfg as a config.json file at path (atomically). */
tera_status tera_hf_write_config(const tera_model_config *cfg, const char *path);
/* Loads every parameter of m (and the router bias when present) from dir. Missing tensors, extra
 * model tensors, or shape mismatches: TERA_ERR_FORMAT naming the tensor. */
tera_status tera_hf_import(tera_model *m, const char *dir);

#endif
