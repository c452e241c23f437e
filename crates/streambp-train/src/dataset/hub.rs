//! A hub dataset id's files in the local hub cache: listed from the hub and downloaded through
//! `hf-hub` (its cache, `HF_HOME`, token and endpoint, as model loading does), or, with
//! `HF_HUB_OFFLINE=1`, read from the cache's snapshot of the `main` revision alone.

use std::path::PathBuf;

use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo, RepoType};

use super::select_split;
use crate::{Result, TrainError};

fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Whether `spec` has the form of a hub id (`owner/name`).
pub fn looks_like_id(spec: &str) -> bool {
    let parts: Vec<&str> = spec.split('/').collect();
    parts.len() == 2 && parts.iter().all(|p| !p.is_empty() && !p.starts_with('.'))
}

/// The files of `id` that hold `split` (of `config`), local: downloaded now (only those), or from
/// the cache offline.
pub fn dataset_files(
    id: &str,
    split: &str,
    config: Option<&str>,
) -> Result<Vec<(String, PathBuf)>> {
    // Named by itself: --data and --eval-data both come here.
    let not_found = |why: String| TrainError::data(id, why);
    if !looks_like_id(id) {
        return Err(not_found(
            "is neither a data file, a directory, nor a hub dataset id of the form owner/name"
                .into(),
        ));
    }
    let cache = Cache::from_env();
    if offline() {
        let cached = cached_files(&cache, id).ok_or_else(|| {
            not_found(format!(
                "no such file or directory, and as a hub dataset it is not in the hub cache ({}) \
                 while HF_HUB_OFFLINE is set",
                cache.path().display()
            ))
        })?;
        return select_split(&cached, split, config).map_err(not_found);
    }
    let hub = |e: hf_hub::api::sync::ApiError| {
        not_found(format!(
            "no such file or directory, and as a hub dataset it could not be fetched: {e}"
        ))
    };
    let api = ApiBuilder::from_env()
        .with_progress(true)
        .build()
        .map_err(hub)?;
    let repo = api.dataset(id.to_string());
    let listed: Vec<(String, PathBuf)> = repo
        .info()
        .map_err(hub)?
        .siblings
        .into_iter()
        .map(|s| (s.rfilename.clone(), PathBuf::from(s.rfilename)))
        .collect();
    let wanted = select_split(&listed, split, config).map_err(not_found)?;
    let mut local = Vec::new();
    for (relative, _) in wanted {
        let name = match config {
            Some(c) => format!("{c}/{relative}"),
            None => relative.clone(),
        };
        local.push((name.clone(), repo.get(&name).map_err(hub)?));
    }
    Ok(local)
}

/// Every file of the cached snapshot of `id`'s `main` revision, or `None` without one.
pub fn cached_files(cache: &Cache, id: &str) -> Option<Vec<(String, PathBuf)>> {
    let repo = Repo::with_revision(id.to_string(), RepoType::Dataset, "main".into());
    let root = cache.path().join(repo.folder_name());
    let commit = std::fs::read_to_string(root.join("refs").join("main")).ok()?;
    let snapshot = root.join("snapshots").join(commit.trim());
    let files = super::local_files(&snapshot).ok()?;
    (!files.is_empty()).then_some(files)
}
