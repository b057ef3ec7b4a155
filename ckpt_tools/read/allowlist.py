"""The one allowlist of pickle globals: exact (module, qualified name) pairs that real checkpoints carry.

A training framework loads its checkpoint with a full unpickler (torch.load without weights_only, `pickle.load`
of DCP's `.metadata`), which imports and calls every global the pickle names. `ckpt` itself never does
(`pickle_reader` turns every global into an inert record), but whatever `ckpt` lets through — into a resume, or
into a file it writes — the framework will run. So one list decides, everywhere: `inspect`'s `unknown-global`
warning, every resume planner's refusal, every writer's source check and its check of what it wrote.

Matching is on the exact pair as the unpickler resolves it (GLOBAL, INST, or STACK_GLOBAL's two strings): never a
prefix, and never a name with a dot in it — protocol 4 resolves `module=torch.serialization, name=os.system` by
walking attributes, reaching `os.system` through an innocent-looking module. The pairs below are data classes,
enums and containers: building one with attacker-chosen arguments runs no code and touches no file.
"""

from __future__ import annotations

#: what torch.save itself names: tensor rebuilds, storages' and dtypes' classes are handled by name patterns
#: in `is_allowed` (torch.<X>Storage, torch.<dtype>); everything else here is listed
_TORCH = {
    ("torch._utils", "_rebuild_tensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_tensor_v3"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_parameter_with_state"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch._utils", "_rebuild_meta_tensor_no_storage"),
    ("torch._utils", "_rebuild_wrapper_subclass"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch", "Tensor"),
    ("torch._tensor", "Tensor"),
    ("torch.nn.parameter", "Parameter"),
    ("torch", "strided"),
    ("torch", "sparse_coo"),
    ("torch.serialization", "_get_layout"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch.storage", "_LegacyStorage"),
}

#: Python's own data types as pickles name them (protocol 0-2 names included)
_PYTHON = {
    ("collections", "OrderedDict"),
    ("collections", "defaultdict"),
    ("collections", "Counter"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "complex"),
    ("builtins", "bytearray"),
    ("builtins", "list"),
    ("builtins", "dict"),
    ("builtins", "tuple"),
    ("builtins", "int"),
    ("builtins", "float"),
    ("builtins", "str"),
    ("builtins", "bytes"),
    ("builtins", "bool"),
    ("__builtin__", "set"),
    ("_codecs", "encode"),
    ("copy_reg", "_reconstructor"),
    ("copyreg", "_reconstructor"),
    ("argparse", "Namespace"),
    ("types", "SimpleNamespace"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib", "Path"),
    ("pathlib._local", "PosixPath"),
    ("pathlib._local", "WindowsPath"),
    ("signal", "Signals"),
    # protocol-2 names of the builtin types (omegaconf and torch.save write types as values)
    *(
        ("__builtin__", n)
        for n in (
            "frozenset",
            "bytearray",
            "complex",
            "slice",
            "dict",
            "list",
            "long",
            "unicode",
            "float",
            "bool",
            "bytes",
            "int",
            "str",
            "tuple",
        )
    ),
    ("typing", "Any"),
    ("typing", "Dict"),
    ("typing", "List"),
    ("typing", "Tuple"),
    ("typing", "Optional"),
    ("datetime", "datetime"),
    ("datetime", "date"),
    ("datetime", "time"),
    ("datetime", "timedelta"),
    ("datetime", "timezone"),
    ("decimal", "Decimal"),
}

#: numpy arrays, scalars and RNG states (torch's and Accelerate's RNG files, DeepSpeed's MoE states)
_NUMPY = {
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "dtype"),
    ("numpy", "ndarray"),
    ("numpy.dtypes", "Float64DType"),
    ("numpy.dtypes", "Float32DType"),
    ("numpy.dtypes", "Int64DType"),
    ("numpy.dtypes", "UInt32DType"),
    ("numpy.dtypes", "Int32DType"),
    # not numpy.random._pickle's constructors: they call an object the pickle passes in (the frameworks store
    # np.random.get_state() tuples, plain data)
}

#: torch.distributed: DCP's .metadata and planner records, ShardedTensor (FSDP1 sharded), DTensor
_TORCH_DISTRIBUTED = {
    *(
        ("torch.distributed.checkpoint.metadata", n)
        for n in (
            "Metadata",
            "MetadataIndex",
            "ChunkStorageMetadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "TensorProperties",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    *(
        ("torch.distributed.checkpoint.planner", n)
        for n in (
            "SavePlan",
            "LoadPlan",
            "WriteItem",
            "ReadItem",
            "WriteItemType",
            "LoadItemType",
            "TensorWriteData",
            "BytesIOWriteData",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch.distributed.checkpoint.filesystem", "SerializationFormat"),
    ("torch.distributed._shard.metadata", "ShardMetadata"),
    ("torch.distributed._shard.sharded_tensor.api", "ShardedTensor"),
    # a nested class, reached by getattr(ShardedTensor, "ProcessGroupState") (see `NESTED`)
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
    ("torch.distributed._shard.sharded_tensor.metadata", "ShardedTensorMetadata"),
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
    ("torch.distributed._shard.sharded_tensor.shard", "Shard"),
    ("torch.distributed._shard.sharding_spec.chunk_sharding_spec", "ChunkShardingSpec"),
    ("torch.distributed.remote_device", "_remote_device"),
    # DTensor and its placements (not DeviceMesh: building one creates process groups)
    ("torch.distributed.tensor", "DTensor"),
    ("torch.distributed.tensor._api", "DTensor"),
    *(("torch.distributed.tensor.placement_types", n) for n in ("Shard", "Replicate", "Partial", "_StridedShard")),
    *(("torch.distributed.tensor._dtensor_spec", n) for n in ("DTensorSpec", "TensorMeta", "ShardOrderEntry")),
    *(
        ("torch.distributed._tensor.placement_types", n)
        for n in ("Shard", "Replicate", "Partial", "_Partial", "DTensorSpec", "TensorMeta")
    ),
    *(("torch.distributed._tensor._dtensor_spec", n) for n in ("DTensorSpec", "TensorMeta")),
    ("torch.distributed._tensor.api", "DTensor"),
    *(
        ("torch.distributed.fsdp.api", n)
        for n in (
            "StateDictType",
            "ShardingStrategy",
            "BackwardPrefetch",
            "CPUOffload",
            "MixedPrecision",
            "FullStateDictConfig",
            "ShardedStateDictConfig",
            "FullOptimStateDictConfig",
            "ShardedOptimStateDictConfig",
        )
    ),
    ("torch.distributed.fsdp", "OffloadPolicy"),
}

#: DeepSpeed's model / optimizer state files
_DEEPSPEED = {
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
    ("deepspeed.runtime.data_pipeline.curriculum_scheduler", "CurriculumScheduler"),  # Megatron-DeepSpeed's args
}

#: Megatron-LM / Megatron-core / Megatron-DeepSpeed `args` values (enums the argument parser builds)
_MEGATRON = {
    ("megatron.core.enums", "ModelType"),
    ("megatron.core.enums", "Fp8Recipe"),
    ("megatron.core.enums", "Fp4Recipe"),
    *(
        ("megatron.core.transformer.enums", n)
        for n in (
            "AttnBackend",
            "AttnMaskType",
            "AttnType",
            "LayerType",
            "ModelType",
            "CudaGraphScope",
            "CudaGraphModule",
            "InferenceCudaGraphScope",
        )
    ),
    *(
        ("megatron.model.enums", n)
        for n in ("ModelType", "AttnMaskType", "AttnType", "LayerType", "PositionEmbeddingType")
    ),
    *(("megatron.legacy.model.enums", n) for n in ("AttnMaskType", "AttnType", "LayerType")),
    *(("megatron.enums", n) for n in ("PositionEmbeddingType", "AttnMaskType", "AttnType", "LayerType")),
    *(("megatron.core.rerun_state_machine", n) for n in ("RerunMode", "RerunState", "RerunDiagnostic")),
    *(("megatron.core.dist_checkpointing.strategies.torch", n) for n in ("MCoreMetadata", "MCoreSavePlan")),
}

#: HF Trainer's training_args.bin, Accelerate's save_state, Lightning's hyper-parameters
_HF_AND_LIGHTNING = {
    ("transformers.training_args", "TrainingArguments"),
    ("transformers.training_args", "OptimizerNames"),
    ("transformers.training_args", "ParallelMode"),
    ("transformers.training_args_seq2seq", "Seq2SeqTrainingArguments"),
    ("transformers.generation.configuration_utils", "GenerationConfig"),
    ("accelerate.parallelism_config", "ParallelismConfig"),
    ("accelerate.utils.deepspeed", "HfDeepSpeedConfig"),
    *(
        ("transformers.trainer_utils", n)
        for n in (
            "IntervalStrategy",
            "SaveStrategy",
            "HubStrategy",
            "SchedulerType",
            "EvaluationStrategy",
            "FSDPOption",
            "ShardedDDPOption",
        )
    ),
    ("transformers.debug_utils", "DebugOption"),
    ("transformers.trainer_pt_utils", "AcceleratorConfig"),
    ("transformers.integrations.deepspeed", "HfDeepSpeedConfig"),
    ("transformers.integrations.deepspeed", "HfTrainerDeepSpeedConfig"),
    ("transformers.deepspeed", "HfDeepSpeedConfig"),
    ("transformers.deepspeed", "HfTrainerDeepSpeedConfig"),
    ("accelerate.state", "PartialState"),
    ("accelerate.state", "AcceleratorState"),
    *(
        ("accelerate.utils.dataclasses", n)
        for n in (
            "DistributedType",
            "DeepSpeedPlugin",
            "FullyShardedDataParallelPlugin",
            "GradientAccumulationPlugin",
            "DynamoBackend",
            "PrecisionType",
            "RNGType",
            "ComputeEnvironment",
            "SageMakerDistributedType",
        )
    ),
    ("lightning.fabric.utilities.data", "AttributeDict"),
    ("pytorch_lightning.utilities.parsing", "AttributeDict"),
    ("lightning_fabric.utilities.data", "AttributeDict"),
    ("lightning.pytorch.utilities.parsing", "AttributeDict"),
    # Lightning hyper-parameters held in an omegaconf DictConfig
    ("omegaconf.dictconfig", "DictConfig"),
    ("omegaconf.listconfig", "ListConfig"),
    ("omegaconf.base", "ContainerMetadata"),
    ("omegaconf.base", "Metadata"),
    *(
        ("omegaconf.nodes", n)
        for n in (
            "AnyNode",
            "StringNode",
            "IntegerNode",
            "FloatNode",
            "BooleanNode",
            "EnumNode",
            "BytesNode",
            "PathNode",
        )
    ),
}

#: every allowed pair
KNOWN: frozenset[tuple[str, str]] = frozenset(
    _TORCH | _PYTHON | _NUMPY | _TORCH_DISTRIBUTED | _DEEPSPEED | _MEGATRON | _HF_AND_LIGHTNING
)

#: classes nested in an allowed class that pickles reach with `getattr(<class>, "<name>")`: (outer, name)
NESTED: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch.distributed._shard.sharded_tensor.api.ShardedTensor", "ProcessGroupState"),
    }
)

#: the dtype names torch.save writes as `torch.<name>` globals
TORCH_DTYPES = frozenset(
    {
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "complex32",
        "complex64",
        "complex128",
        "float",
        "double",
        "half",
        "long",
        "int",
        "short",
        "cfloat",
        "cdouble",
        "chalf",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
        "qint8",
        "quint8",
        "qint32",
        "quint4x2",
        "bits8",
        "bits16",
    }
)


#: globals that pass only where each call is checked: the inert reader flags every `getattr` that does not reach a
#: `NESTED` class (a full unpickler's getattr on a real object is how hostile chains reach os.system)
CHECKED_CALLS: frozenset[tuple[str, str]] = frozenset({("builtins", "getattr"), ("__builtin__", "getattr")})


def is_allowed(module: str, name: str, *, calls_checked: bool = False) -> bool:
    """Whether a pickle naming `module` / `name` may pass: the exact pair is listed (or is torch's storage or
    dtype naming). A `name` with a dot never passes: it would walk into another module. `calls_checked`: the
    caller judged every call of `CHECKED_CALLS` itself (the inert reader does)."""
    if not isinstance(module, str) or not isinstance(name, str) or "." in name:
        return False
    if (module, name) in KNOWN or calls_checked and (module, name) in CHECKED_CALLS:
        return True
    return module == "torch" and (name in TORCH_DTYPES or (name.endswith("Storage") and name.isidentifier()))


def is_allowed_nested(outer: str, name: str) -> bool:
    """Whether `getattr(<outer class>, name)` reaches a listed nested class."""
    return (outer, name) in NESTED


def dotted(module: str, name: str) -> str:
    """The name a message shows for a pair (module and name kept apart by a colon when the name has a dot, so
    that `torch.serialization` + `os.system` does not read as a torch class)."""
    return f"{module}.{name}" if "." not in str(name) else f"{module}:{name}"
