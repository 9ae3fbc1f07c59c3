"""Tensor parallelism (chapter 13). Exported from chapters/13_tensor_parallel.ipynb
(this file only describes the parts):

    shard.py    split, head_split, local_config, shard_slice; RowParallelLinear,
                VocabParallelEmbedding, VocabParallelHead, ShardedTransformer;
                load_shard (one rank's slices of a checkpoint)
    workers.py  WorkerGroup (rank 0 starts, steps and stops the other ranks),
                worker_main (what each of them runs)
    engine.py   LLM(folder, tensor_parallel_size=N), load_parallel
    serve.py    `python -m minillm serve MODEL --tensor-parallel-size N`
    plan.py     plan_parallel: the tensor and pipeline sizes a model needs
"""
