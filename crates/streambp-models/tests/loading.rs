//! Loading: sharded checkpoints, the hub cache, both config styles, and a clear typed error for each
//! kind of broken input.

mod common;

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use common::*;
use streambp_models::{load_model, ModelConfig, ModelError};

/// A copy of a fixture's model files in a temporary directory, to break at will.
fn copy_fixture(family: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture_dir(family).join(file), dir.path().join(file)).unwrap();
    }
    dir
}

fn fixture_tensors(family: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture_dir(family).join("model.safetensors"), &Device::Cpu)
        .unwrap()
}

fn load(dir: &Path) -> Result<streambp_models::Model, ModelError> {
    load_model(dir, DType::F64, &Device::Cpu)
}

fn logits(model: &streambp_models::Model, family: &str) -> Tensor {
    let r = reference(family);
    let ids = r["input_ids"].to_dtype(DType::U32).unwrap();
    model
        .detached()
        .forward(&ids, Some(&r["attention_mask"]))
        .unwrap()
}

#[test]
fn sharded_checkpoint_loads_like_the_single_file() {
    let family = "qwen2";
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture_dir(family).join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let tensors = fixture_tensors(family);
    let mut names: Vec<_> = tensors.keys().cloned().collect();
    names.sort();
    let mut weight_map = serde_json::Map::new();
    for (shard, chunk) in names.chunks(names.len() / 2 + 1).enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", shard + 1);
        let part: HashMap<_, _> = chunk
            .iter()
            .map(|n| (n.clone(), tensors[n].clone()))
            .collect();
        candle_core::safetensors::save(&part, dir.path().join(&file)).unwrap();
        for n in chunk {
            weight_map.insert(n.clone(), file.clone().into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();

    let sharded = load(dir.path()).unwrap();
    let single = load(&fixture_dir(family)).unwrap();
    assert_eq!(
        rel_err(&logits(&sharded, family), &logits(&single, family)),
        0.0
    );

    // An index pointing at a shard that is not there names the shard.
    std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    match load(dir.path()) {
        Err(ModelError::MissingShard { file, .. }) => {
            assert_eq!(file, "model-00002-of-00002.safetensors")
        }
        other => panic!("expected MissingShard, got {other:?}"),
    }
}

#[test]
fn missing_config_is_an_io_error_naming_the_file() {
    let dir = copy_fixture("qwen3");
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    let err = load(dir.path()).unwrap_err();
    assert!(
        matches!(err, ModelError::Io { ref path, .. } if path.ends_with("config.json")),
        "{err}"
    );
}

#[test]
fn unknown_model_type_is_named() {
    let dir = copy_fixture("qwen3");
    let path = dir.path().join("config.json");
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("\"qwen3\"", "\"mamba\"");
    std::fs::write(&path, text).unwrap();
    let err = load(dir.path()).unwrap_err();
    assert!(
        matches!(err, ModelError::UnknownModelType { ref model_type, .. } if model_type == "mamba")
    );
    assert!(err.to_string().contains("mamba") && err.to_string().contains("config.json"));
}

#[test]
fn missing_weights_file_is_reported() {
    let dir = copy_fixture("qwen3");
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    assert!(matches!(
        load(dir.path()),
        Err(ModelError::NoWeights { .. })
    ));
}

#[test]
fn missing_tensor_is_named() {
    let dir = copy_fixture("llama3");
    let mut tensors = fixture_tensors("llama3");
    tensors.remove("model.layers.1.mlp.up_proj.weight");
    candle_core::safetensors::save(&tensors, dir.path().join("model.safetensors")).unwrap();
    let err = load(dir.path()).unwrap_err();
    assert!(
        matches!(err, ModelError::MissingTensor { ref name, .. } if name == "model.layers.1.mlp.up_proj.weight"),
        "{err}"
    );
    assert!(err.to_string().contains("model.safetensors"));
}

#[test]
fn wrong_shape_names_tensor_file_and_shapes() {
    let dir = copy_fixture("gemma3");
    let mut tensors = fixture_tensors("gemma3");
    tensors.insert(
        "model.layers.0.self_attn.k_norm.weight".into(),
        Tensor::zeros(7, DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, dir.path().join("model.safetensors")).unwrap();
    match load(dir.path()) {
        Err(ModelError::ShapeMismatch {
            name,
            path,
            expected,
            found,
        }) => {
            assert_eq!(name, "model.layers.0.self_attn.k_norm.weight");
            assert!(path.ends_with("model.safetensors"));
            assert_eq!((expected, found), (vec![16], vec![7]));
        }
        other => panic!("expected ShapeMismatch, got {other:?}"),
    }
}

#[test]
fn truncated_safetensors_is_a_clear_error() {
    let dir = copy_fixture("qwen2");
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = load(dir.path()).unwrap_err();
    assert!(
        matches!(err, ModelError::BadSafetensors { ref path, .. } if path.ends_with("model.safetensors")),
        "{err}"
    );
}

#[test]
fn checkpoint_converts_to_the_requested_dtype() {
    for dtype in [DType::F32, DType::BF16, DType::F64] {
        let model = load_model(&fixture_dir("qwen3"), dtype, &Device::Cpu).unwrap();
        assert!(model.parameters().iter().all(|(_, v)| v.dtype() == dtype));
    }
}

#[test]
fn tied_embeddings_are_one_parameter() {
    let tied = load(&fixture_dir("qwen3")).unwrap();
    assert!(tied.parameters().iter().all(|(n, _)| n != "lm_head.weight"));
    let untied = load(&fixture_dir("qwen2")).unwrap();
    assert!(untied
        .parameters()
        .iter()
        .any(|(n, _)| n == "lm_head.weight"));
}

/// A model in the layout `hf-hub` keeps its cache in is found there without any network.
#[test]
fn hub_cache_is_used_offline() {
    let cache = tempfile::tempdir().unwrap();
    let repo = cache.path().join("models--tiny--qwen3");
    let snapshot = repo.join("snapshots").join("abc123");
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs").join("main"), "abc123").unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture_dir("qwen3").join(file), snapshot.join(file)).unwrap();
    }
    let hub = hf_hub::Cache::new(cache.path().to_path_buf());
    let dir = streambp_models::hub::cached_model_dir(&hub, "tiny/qwen3").unwrap();
    assert_eq!(dir, snapshot);
    load(&dir).unwrap();
    assert!(streambp_models::hub::cached_model_dir(&hub, "tiny/other").is_none());
}

#[test]
fn model_spec_that_is_neither_dir_nor_id_is_rejected() {
    let err = streambp_models::resolve_model_dir("./no/such/dir/here").unwrap_err();
    assert!(
        err.to_string()
            .contains("neither an existing directory nor a hub id"),
        "{err}"
    );
}

/// Older checkpoints spell rope and layer types the legacy way; both styles give the same config.
#[test]
fn legacy_and_new_config_styles_agree() {
    let new_style = ModelConfig::from_file(&fixture_dir("gemma3").join("config.json")).unwrap();
    let mut legacy: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture_dir("gemma3").join("config.json")).unwrap(),
    )
    .unwrap();
    let obj = legacy.as_object_mut().unwrap();
    obj.remove("rope_parameters");
    obj.remove("layer_types");
    obj.insert("rope_theta".into(), 1_000_000.0.into());
    obj.insert("rope_local_base_freq".into(), 10_000.0.into());
    obj.insert(
        "rope_scaling".into(),
        serde_json::json!({"rope_type": "linear", "factor": 8.0}),
    );
    obj.insert("sliding_window_pattern".into(), 3.into());
    let legacy = ModelConfig::from_json(&legacy, Path::new("legacy.json")).unwrap();
    assert_eq!(legacy, new_style);

    let new_llama = ModelConfig::from_file(&fixture_dir("llama3").join("config.json")).unwrap();
    let mut legacy: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture_dir("llama3").join("config.json")).unwrap(),
    )
    .unwrap();
    let obj = legacy.as_object_mut().unwrap();
    let mut scaling = obj.remove("rope_parameters").unwrap();
    obj.insert("rope_theta".into(), scaling["rope_theta"].clone());
    scaling.as_object_mut().unwrap().remove("rope_theta");
    scaling.as_object_mut().unwrap().remove("rope_type");
    scaling
        .as_object_mut()
        .unwrap()
        .insert("type".into(), "llama3".into());
    obj.insert("rope_scaling".into(), scaling);
    obj.remove("layer_types");
    assert_eq!(
        ModelConfig::from_json(&legacy, Path::new("legacy.json")).unwrap(),
        new_llama
    );
}

#[test]
fn unsupported_rope_scaling_is_rejected() {
    let mut cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture_dir("qwen2").join("config.json")).unwrap(),
    )
    .unwrap();
    cfg["rope_parameters"] =
        serde_json::json!({"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6});
    let err = ModelConfig::from_json(&cfg, Path::new("c.json")).unwrap_err();
    assert!(err.to_string().contains("yarn"), "{err}");
}

#[test]
fn out_of_vocabulary_ids_are_an_error() {
    let model = load(&fixture_dir("qwen2")).unwrap();
    let ids = Tensor::new(&[[1u32, 96]], &Device::Cpu).unwrap();
    let err = model.detached().forward(&ids, None).unwrap_err();
    assert!(err.to_string().contains("out of the vocabulary"), "{err}");
}

/// The bench's real-model configs read as the published models: parameter counts match exactly.
#[test]
fn shipped_bench_configs_have_the_published_parameter_counts() {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../benches/configs");
    for (file, expected) in [
        ("llama-3.2-1b.json", 1_235_814_400u64),
        ("gemma3-1b.json", 999_885_952),
        ("qwen3-0.6b.json", 596_049_920),
        ("qwen3-4b.json", 4_022_468_096),
        ("qwen3-8b.json", 8_190_735_360),
    ] {
        let cfg = ModelConfig::from_file(&dir.join(file)).unwrap();
        let count: u64 = cfg
            .parameter_shapes()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>() as u64)
            .sum();
        assert_eq!(count, expected, "{file}");
    }
}
