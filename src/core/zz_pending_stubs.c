/* TEMPORARY weak stubs while the API is being filled in by parallel work; removed before landing. */
#include "core/core.h"
#include <math.h>
#pragma GCC diagnostic ignored "-Wunused-parameter"
__attribute__((weak)) ampc_tensor * ampc_add(ampc_tensor *a, ampc_tensor *b) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_add not implemented yet"); return NULL; }
__attribute__((weak)) ampc_tensor * ampc_sub(ampc_tensor *a, ampc_tensor *b) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_sub not implemented yet"); return NULL; }
__attribute__((weak)) ampc_tensor * ampc_mul(ampc_tensor *a, ampc_tensor *b) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_mul not implemented yet"); return NULL; }
__attribute__((weak)) ampc_tensor * ampc_add_scalar(ampc_tensor *a, double s) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_add_scalar not implemented yet"); return NULL; }
__attribute__((weak)) ampc_tensor * ampc_mul_scalar(ampc_tensor *a, double s) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_mul_scalar not implemented yet"); return NULL; }
__attribute__((weak)) ampc_tensor * ampc_relu(ampc_tensor *x) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_relu not implemented yet"); return NULL; }
__attribute__((weak)) ampc_tensor * ampc_gelu(ampc_tensor *x) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_gelu not implemented yet"); return NULL; }
__attribute__((weak)) ampc_tensor * ampc_tanh(ampc_tensor *x) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_tanh not implemented yet"); return NULL; }
__attribute__((weak)) ampc_tensor * ampc_sigmoid(ampc_tensor *x) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_sigmoid not implemented yet"); return NULL; }
__attribute__((weak)) ampc_tensor * ampc_exp(ampc_tensor *x) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_exp not implemented yet"); return NULL; }
__attribute__((weak)) ampc_tensor * ampc_log(ampc_tensor *x) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_log not implemented yet"); return NULL; }
__attribute__((weak)) ampc_tensor * ampc_pow(ampc_tensor *x, double exponent) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_pow not implemented yet"); return NULL; }
__attribute__((weak)) ampc_tensor * ampc_sum(ampc_tensor *x, int dim, bool keepdim) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_sum not implemented yet"); return NULL; }
__attribute__((weak)) ampc_tensor * ampc_mean(ampc_tensor *x, int dim, bool keepdim) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_mean not implemented yet"); return NULL; }
__attribute__((weak)) ampc_tensor * ampc_softmax(ampc_tensor *x, int dim) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_softmax not implemented yet"); return NULL; }
__attribute__((weak)) ampc_tensor * ampc_log_softmax(ampc_tensor *x, int dim) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_log_softmax not implemented yet"); return NULL; }
__attribute__((weak)) ampc_tensor * ampc_matmul(ampc_tensor *a, ampc_tensor *b) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_matmul not implemented yet"); return NULL; }
__attribute__((weak)) ampc_tensor * ampc_linear(ampc_tensor *x, ampc_tensor *w, ampc_tensor *b) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_linear not implemented yet"); return NULL; }
__attribute__((weak)) ampc_tensor * ampc_mse_loss(ampc_tensor *input, ampc_tensor *target, ampc_reduction r) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_mse_loss not implemented yet"); return NULL; }
__attribute__((weak)) ampc_cross_entropy_options ampc_cross_entropy_defaults(void) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_cross_entropy_defaults not implemented yet"); ampc_cross_entropy_options o = {0}; return o; }
__attribute__((weak)) ampc_tensor * ampc_cross_entropy(ampc_tensor *logits, ampc_tensor *targets,
                                const ampc_cross_entropy_options *opts) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_cross_entropy not implemented yet"); return NULL; }
__attribute__((weak)) ampc_tensor * ampc_dropout(ampc_tensor *x, double p, bool training) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_dropout not implemented yet"); return NULL; }
__attribute__((weak)) ampc_module * ampc_linear_new(int64_t in_features, int64_t out_features, bool bias) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_linear_new not implemented yet"); return NULL; }
__attribute__((weak)) ampc_module * ampc_relu_new(void) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_relu_new not implemented yet"); return NULL; }
__attribute__((weak)) ampc_module * ampc_gelu_new(void) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_gelu_new not implemented yet"); return NULL; }
__attribute__((weak)) ampc_module * ampc_tanh_new(void) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_tanh_new not implemented yet"); return NULL; }
__attribute__((weak)) ampc_module * ampc_sigmoid_new(void) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_sigmoid_new not implemented yet"); return NULL; }
__attribute__((weak)) ampc_module * ampc_dropout_new(double p) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_dropout_new not implemented yet"); return NULL; }
__attribute__((weak)) ampc_module * ampc_flatten_new(void) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_flatten_new not implemented yet"); return NULL; }
__attribute__((weak)) ampc_module * ampc_sequential(int n, ...) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_sequential not implemented yet"); return NULL; }
__attribute__((weak)) ampc_module * ampc_sequential_from(int n, ampc_module **children) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_sequential_from not implemented yet"); return NULL; }
__attribute__((weak)) ampc_tensor * ampc_module_forward(ampc_module *m, ampc_tensor *x) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_module_forward not implemented yet"); return NULL; }
__attribute__((weak)) void ampc_module_train(ampc_module *m, bool training) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_module_train not implemented yet");  }
__attribute__((weak)) bool ampc_module_is_training(const ampc_module *m) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_module_is_training not implemented yet"); return false; }
__attribute__((weak)) const char * ampc_module_type(const ampc_module *m) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_module_type not implemented yet"); return NULL; }
__attribute__((weak)) int ampc_module_num_children(const ampc_module *m) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_module_num_children not implemented yet"); return -6; }
__attribute__((weak)) ampc_module * ampc_module_child(ampc_module *m, int i) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_module_child not implemented yet"); return NULL; }
__attribute__((weak)) int ampc_module_parameters(ampc_module *m, ampc_tensor ***params, const char ***names) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_module_parameters not implemented yet"); return -6; }
__attribute__((weak)) int64_t ampc_module_num_parameters(ampc_module *m, bool trainable_only) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_module_num_parameters not implemented yet"); return -6; }
__attribute__((weak)) void ampc_module_requires_grad(ampc_module *m, bool on) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_module_requires_grad not implemented yet");  }
__attribute__((weak)) void ampc_module_free(ampc_module *m) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_module_free not implemented yet");  }
__attribute__((weak)) ampc_sgd_options ampc_sgd_defaults(void) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_sgd_defaults not implemented yet"); ampc_sgd_options o = {0}; return o; }
__attribute__((weak)) ampc_adam_options ampc_adam_defaults(void) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_adam_defaults not implemented yet"); ampc_adam_options o = {0}; return o; }
__attribute__((weak)) ampc_adam_options ampc_adamw_defaults(void) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_adamw_defaults not implemented yet"); ampc_adam_options o = {0}; return o; }
__attribute__((weak)) ampc_optimizer * ampc_sgd_new(ampc_module *m, const ampc_sgd_options *opts) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_sgd_new not implemented yet"); return NULL; }
__attribute__((weak)) ampc_optimizer * ampc_adam_new(ampc_module *m, const ampc_adam_options *opts) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_adam_new not implemented yet"); return NULL; }
__attribute__((weak)) ampc_optimizer * ampc_adamw_new(ampc_module *m, const ampc_adam_options *opts) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_adamw_new not implemented yet"); return NULL; }
__attribute__((weak)) ampc_optimizer * ampc_sgd_new_params(ampc_tensor **params, int n, const ampc_sgd_options *opts) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_sgd_new_params not implemented yet"); return NULL; }
__attribute__((weak)) ampc_optimizer * ampc_adam_new_params(ampc_tensor **params, int n, const ampc_adam_options *opts) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_adam_new_params not implemented yet"); return NULL; }
__attribute__((weak)) ampc_optimizer * ampc_adamw_new_params(ampc_tensor **params, int n, const ampc_adam_options *opts) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_adamw_new_params not implemented yet"); return NULL; }
__attribute__((weak)) int ampc_optimizer_step(ampc_optimizer *opt) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_optimizer_step not implemented yet"); return -6; }
__attribute__((weak)) void ampc_optimizer_zero_grad(ampc_optimizer *opt) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_optimizer_zero_grad not implemented yet");  }
__attribute__((weak)) double ampc_optimizer_get_lr(const ampc_optimizer *opt) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_optimizer_get_lr not implemented yet"); return NAN; }
__attribute__((weak)) void ampc_optimizer_set_lr(ampc_optimizer *opt, double lr) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_optimizer_set_lr not implemented yet");  }
__attribute__((weak)) int ampc_optimizer_num_params(const ampc_optimizer *opt) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_optimizer_num_params not implemented yet"); return -6; }
__attribute__((weak)) ampc_tensor * ampc_optimizer_param(const ampc_optimizer *opt, int i) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_optimizer_param not implemented yet"); return NULL; }
__attribute__((weak)) void ampc_optimizer_free(ampc_optimizer *opt) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_optimizer_free not implemented yet");  }
__attribute__((weak)) double ampc_clip_grad_norm(ampc_optimizer *opt, double max_norm) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_clip_grad_norm not implemented yet"); return NAN; }
__attribute__((weak)) ampc_scaler_options ampc_scaler_defaults(void) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_scaler_defaults not implemented yet"); ampc_scaler_options o = {0}; return o; }
__attribute__((weak)) ampc_scaler * ampc_scaler_new(const ampc_scaler_options *opts) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_scaler_new not implemented yet"); return NULL; }
__attribute__((weak)) ampc_tensor * ampc_scaler_scale(ampc_scaler *s, ampc_tensor *loss) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_scaler_scale not implemented yet"); return NULL; }
__attribute__((weak)) int ampc_scaler_unscale(ampc_scaler *s, ampc_optimizer *opt) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_scaler_unscale not implemented yet"); return -6; }
__attribute__((weak)) int ampc_scaler_step(ampc_scaler *s, ampc_optimizer *opt) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_scaler_step not implemented yet"); return -6; }
__attribute__((weak)) int ampc_scaler_update(ampc_scaler *s) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_scaler_update not implemented yet"); return -6; }
__attribute__((weak)) void ampc_scaler_set_scale(ampc_scaler *s, float new_scale) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_scaler_set_scale not implemented yet");  }
__attribute__((weak)) float ampc_scaler_get_scale(const ampc_scaler *s) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_scaler_get_scale not implemented yet"); return NAN; }
__attribute__((weak)) int ampc_scaler_growth_tracker(const ampc_scaler *s) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_scaler_growth_tracker not implemented yet"); return -6; }
__attribute__((weak)) bool ampc_scaler_is_enabled(const ampc_scaler *s) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_scaler_is_enabled not implemented yet"); return false; }
__attribute__((weak)) int64_t ampc_scaler_steps_applied(const ampc_scaler *s) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_scaler_steps_applied not implemented yet"); return -6; }
__attribute__((weak)) int64_t ampc_scaler_steps_skipped(const ampc_scaler *s) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_scaler_steps_skipped not implemented yet"); return -6; }
__attribute__((weak)) bool ampc_scaler_found_inf(const ampc_scaler *s, const ampc_optimizer *opt) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_scaler_found_inf not implemented yet"); return false; }
__attribute__((weak)) void ampc_scaler_free(ampc_scaler *s) { ampc__err(AMPC_ERR_UNSUPPORTED, "ampc_scaler_free not implemented yet");  }
