"""Target models: the wrapped causal LM and its tree forward (`model`), where targets come from
(`loading`), KV caches (`cache`, `static_cache`), static-shape and CUDA-graph forwards (`graphs`,
`forwards`), the attention function (`attention`) and the linear kernels (`kernels`).
"""
