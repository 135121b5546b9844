/* Hugging Face interchange: a Mixtral directory (config.json + model.safetensors, or shards with
 * model.safetensors.index.json). config.json's model_type is "mixtral" only for a model that
 * transformers' MixtralForCausalLM computes exactly, else "tera_moe" (tera_hf_transformers_gaps).
 * Options Mixtral cannot express use DeepSeek-V3 / Qwen-MoE names:
 *   model.layers.{l}.mlp.shared_experts.{gate,up,down}_proj.weight      shared experts
 *   model.layers.{l}.mlp.{gate,up,down}_proj.weight                     dense layers
 *   model.layers.{l}.block_sparse_moe.gate.e_score_correction_bias      aux-free bias (F32 [E])
 *   config.json: n_shared_experts, moe_intermediate_size, first_k_dense_replace, scoring_func,
 *   n_group, topk_group, routed_scaling_factor, ... */
#ifndef TERA_HF_H
#define TERA_HF_H

#include "tera/model.h"
#include "tera/safetensors.h"

/* Writes config.json and the weights (sharded when max_shard_bytes > 0 and exceeded). The
 * directory is created if missing; an existing non-empty directory is refused unless overwrite.
 * Checkpoints use it for any model (config.json labelled as above). */
tera_status tera_hf_export(const tera_model *m, const char *dir, int64_t max_shard_bytes, int overwrite);
/* tera_hf_export for `tera export-hf` / `tera ckpt export-hf`: a model with features no
 * transformers class computes is refused (TERA_ERR_CONFIG naming them) unless allow_tera_moe. */
tera_status tera_hf_export_checked(const tera_model *m, const char *dir, int64_t max_shard_bytes, int overwrite,
                                   int allow_tera_moe);
/* tera_hf_export_checked without the weights in memory: m has the one-process table, the config
 * and the router bias (m->w unused); src fills elements [lo, lo + n) of parameter i (flat, global)
 * into dst, called in table order in pieces of at most 1 Mi floats. The same files, byte for byte. */
typedef tera_status (*tera_hf_source)(void *ctx, int i, int64_t lo, int64_t n, float *dst);
tera_status tera_hf_export_source(const tera_model *m, const char *dir, int64_t max_shard_bytes, int overwrite,
                                  int allow_tera_moe, tera_hf_source src, void *ctx);
/* The features of cfg that make it differ from transformers' MixtralForCausalLM at inference
 * (dense first layers, shared experts, the aux-free router bias, a capacity factor that can drop
 * tokens): their number, and a "; "-separated list in buf (cap may be 0). 0 = exactly Mixtral. */
int tera_hf_transformers_gaps(const tera_model_config *cfg, char *buf, size_t cap);
/* The config.json name of the tera_model_config member at member_offset, or NULL. */
const char *tera_hf_config_key(size_t member_offset);
/* Reads config.json into cfg (fields not present keep their current value). */
tera_status tera_hf_read_config(const char *dir, tera_model_config *cfg);
/* Writes cfg as a config.json file at path (atomically). */
tera_status tera_hf_write_config(const tera_model_config *cfg, const char *path);
/* Loads every parameter of m (and the router bias when present) from dir. Missing tensors, extra
 * model tensors, or shape mismatches: TERA_ERR_FORMAT naming the tensor. */
tera_status tera_hf_import(tera_model *m, const char *dir);
/* tera_hf_import's checks on an open directory without reading the weights into memory (no tensor
 * the model lacks; a tied lm_head.weight equal to the embedding, compared in bounded windows): the
 * checkpoint reader runs them when it reads a Hugging Face directory range by range. */
tera_status tera_hf_check_set(const tera_model *m, const tera_st_set *set, const char *dir);


#endif
