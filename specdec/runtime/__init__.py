"""The target runtime: the wrapped causal LM and its tree forward (`model`), KV caches (`cache`,
`static_cache`), static-shape and CUDA-graph forwards (`graphs`, `forwards`), the attention function
(`attention`) and the linear kernels (`kernels`). Stands on the records (`specdec.core`); knows nothing
about where targets come from (`specdec.loading`), drafters or the loop.
"""
