//! Which files of a data set hold a split, by `datasets.load_dataset`'s conventions for data sets
//! without a loading script, in its order:
//! 1. sharded files `data/<split>-00000-of-00002.parquet` (what `push_to_hub` writes): any split name;
//! 2. a directory named by the split (`train/`, `test/`, `valid/`…);
//! 3. a file named by the split (`train.jsonl`, `my_test-1.parquet`…);
//! 4. otherwise every file is the `train` split.
//!
//! For 2 and 3 the names that count are `datasets`' keywords (train: train, training; validation:
//! validation, valid, dev, val; test: test, testing, eval, evaluation), separated from the rest of the
//! name by `-`, `.`, `_`, a space or a digit. With `--data-config NAME` only the files under the
//! top-level directory `NAME/` count (the layout of data sets with several configurations).

use std::collections::BTreeSet;
use std::path::PathBuf;

/// `datasets`' split keywords.
const KEYWORDS: [(&str, &[&str]); 3] = [
    ("train", &["train", "training"]),
    ("validation", &["validation", "valid", "dev", "val"]),
    ("test", &["test", "testing", "eval", "evaluation"]),
];

fn is_sep(c: char) -> bool {
    matches!(c, '-' | '.' | '_' | ' ') || c.is_ascii_digit()
}

/// Whether `name` holds `keyword` as a word: the whole name, at its start followed by a separator, or
/// between separators (`ends` also allows it at the end: directory names).
fn holds_word(name: &str, keyword: &str, ends: bool) -> bool {
    let mut from = 0;
    while let Some(i) = name[from..].find(keyword) {
        let start = from + i;
        let end = start + keyword.len();
        let before = start == 0 || name[..start].chars().next_back().is_some_and(is_sep);
        let after = match name[end..].chars().next() {
            Some(c) => is_sep(c),
            None => ends || start == 0,
        };
        if before && after {
            return true;
        }
        from = start + 1;
    }
    false
}

/// The keywords that name `split` (itself for a split outside `datasets`' three).
fn keywords(split: &str) -> Vec<&str> {
    KEYWORDS
        .iter()
        .find(|(name, words)| *name == split || words.contains(&split))
        .map(|(_, words)| words.to_vec())
        .unwrap_or_else(|| vec![split])
}

/// The split of a sharded file `data/<split>-NNNNN-of-NNNNN…`.
fn sharded_split(relative: &str) -> Option<&str> {
    let name = relative.strip_prefix("data/")?;
    if name.contains('/') {
        return None;
    }
    let (split, rest) = name.split_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    let (first, rest) = rest.split_once("-of-")?;
    (digits(first) && rest.get(..5).is_some_and(digits)).then_some(split)
}

fn in_dir_name(relative: &str, keyword: &str) -> bool {
    let mut parts: Vec<&str> = relative.split('/').collect();
    parts.pop();
    parts.iter().any(|dir| holds_word(dir, keyword, true))
}

fn in_file_name(relative: &str, keyword: &str) -> bool {
    let name = relative.rsplit('/').next().unwrap_or(relative);
    holds_word(name, keyword, false)
}

/// The files of `split` among `files` (relative path with `/`, local path), or why there are none.
pub fn select_split(
    files: &[(String, PathBuf)],
    split: &str,
    config: Option<&str>,
) -> std::result::Result<Vec<(String, PathBuf)>, String> {
    let files: Vec<(String, PathBuf)> = match config {
        None => files.to_vec(),
        Some(c) => {
            let prefix = format!("{c}/");
            let under: Vec<(String, PathBuf)> = files
                .iter()
                .filter_map(|(rel, p)| Some((rel.strip_prefix(&prefix)?.to_string(), p.clone())))
                .collect();
            if under.is_empty() {
                let dirs: BTreeSet<&str> = files
                    .iter()
                    .filter_map(|(rel, _)| rel.split_once('/').map(|(d, _)| d))
                    .collect();
                return Err(format!(
                    "no configuration {c:?} (no directory {c}/; top-level directories: {})",
                    list(dirs)
                ));
            }
            under
        }
    };
    let data: Vec<&(String, PathBuf)> = files.iter().filter(|(rel, _)| is_data_file(rel)).collect();
    if data.is_empty() {
        return Err("holds no .jsonl, .json or .parquet file".into());
    }
    let pick = |matches: &dyn Fn(&str) -> bool| -> Vec<(String, PathBuf)> {
        data.iter()
            .filter(|(rel, _)| matches(rel))
            .map(|f| (*f).clone())
            .collect()
    };
    // 1. Sharded files name their splits.
    let sharded: BTreeSet<&str> = data.iter().filter_map(|(r, _)| sharded_split(r)).collect();
    if !sharded.is_empty() {
        let chosen = pick(&|r| sharded_split(r) == Some(split));
        return non_empty(chosen, split, list(sharded));
    }
    // 2 and 3. Directories, then file names, with the keywords.
    type Rule = fn(&str, &str) -> bool;
    for rule in [in_dir_name as Rule, in_file_name as Rule] {
        let found: BTreeSet<&str> = KEYWORDS
            .iter()
            .filter(|(_, words)| data.iter().any(|(r, _)| words.iter().any(|w| rule(r, w))))
            .map(|(name, _)| *name)
            .collect();
        if !found.is_empty() {
            let words = keywords(split);
            let chosen = pick(&|r| words.iter().any(|w| rule(r, w)));
            return non_empty(chosen, split, list(found));
        }
    }
    // 4. One split.
    match split {
        "train" => non_empty(pick(&|_| true), split, "train".into()),
        _ => Err(format!(
            "no split {split:?}: the files name no split, so they all are \"train\""
        )),
    }
}

fn is_data_file(relative: &str) -> bool {
    let lower = relative.to_ascii_lowercase();
    [".parquet", ".jsonl", ".json"]
        .iter()
        .any(|ext| lower.ends_with(ext))
}

fn list<'a>(names: impl IntoIterator<Item = &'a str>) -> String {
    names
        .into_iter()
        .map(|n| format!("{n:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn non_empty(
    chosen: Vec<(String, PathBuf)>,
    split: &str,
    found: String,
) -> std::result::Result<Vec<(String, PathBuf)>, String> {
    match chosen.is_empty() {
        true => Err(format!("no split {split:?} (splits found: {found})")),
        false => Ok(chosen),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(names: &[&str]) -> Vec<(String, PathBuf)> {
        names
            .iter()
            .map(|n| (n.to_string(), PathBuf::from(n)))
            .collect()
    }

    fn chosen(names: &[&str], split: &str, config: Option<&str>) -> Vec<String> {
        match select_split(&files(names), split, config) {
            Ok(f) => f.into_iter().map(|(r, _)| r).collect(),
            Err(e) => vec![format!("error: {e}")],
        }
    }

    #[test]
    fn sharded_files_name_any_split() {
        let hub = [
            "README.md",
            ".gitattributes",
            "data/train-00000-of-00002.parquet",
            "data/train-00001-of-00002.parquet",
            "data/test_prefs-00000-of-00001.parquet",
        ];
        assert_eq!(
            chosen(&hub, "train", None),
            [
                "data/train-00000-of-00002.parquet",
                "data/train-00001-of-00002.parquet"
            ]
        );
        assert_eq!(
            chosen(&hub, "test_prefs", None),
            ["data/test_prefs-00000-of-00001.parquet"]
        );
        assert!(chosen(&hub, "test", None)[0].contains("splits found: \"test_prefs\", \"train\""));
    }

    #[test]
    fn directories_then_file_names_then_everything() {
        let dirs = ["train/a.parquet", "train/b.parquet", "valid/a.parquet"];
        assert_eq!(
            chosen(&dirs, "train", None),
            ["train/a.parquet", "train/b.parquet"]
        );
        assert_eq!(chosen(&dirs, "validation", None), ["valid/a.parquet"]);
        let named = [
            "train.jsonl",
            "my_test-1.jsonl",
            "attest.jsonl",
            "notes.txt",
        ];
        assert_eq!(chosen(&named, "test", None), ["my_test-1.jsonl"]);
        assert_eq!(chosen(&named, "train", None), ["train.jsonl"]);
        let plain = ["part-a.parquet", "part-b.parquet"];
        assert_eq!(chosen(&plain, "train", None), plain);
        assert!(chosen(&plain, "test", None)[0].contains("all are \"train\""));
    }

    #[test]
    fn a_config_is_a_top_level_directory() {
        let configs = [
            "en/train-0.parquet",
            "fr/train-0.parquet",
            "fr/test-0.parquet",
        ];
        assert_eq!(chosen(&configs, "test", Some("fr")), ["test-0.parquet"]);
        assert!(chosen(&configs, "train", Some("de"))[0].contains("\"en\", \"fr\""));
    }
}
