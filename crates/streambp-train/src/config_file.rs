//! `--config FILE.toml`: a run configuration whose keys mirror the command-line flags
//! (`max_steps = 100` or `max-steps = 100` for `--max-steps 100`). The file's values become flags; a flag
//! also typed on the command line overrides the file's.

use std::path::Path;

use crate::{Result, TrainError};

/// The largest config file read: a page of settings is a few KiB.
pub const MAX_BYTES: u64 = 1 << 20;

/// The flags a config file stands for, in file order: `(flag, value)` (no value for a `true` switch).
/// `is_switch` tells the flags that take no value (`Some(true)`, set with a boolean here and nothing
/// else) from those that take one (`Some(false)`); an unknown flag (`None`) is left for the command
/// line's parser to name.
pub fn flags_from_toml(
    path: &Path,
    is_switch: &dyn Fn(&str) -> Option<bool>,
) -> Result<Vec<(String, Option<String>)>> {
    let bad = |reason: String| TrainError::ConfigFile {
        path: path.to_path_buf(),
        reason,
    };
    let text = crate::input_file::read_text(path, MAX_BYTES).map_err(bad)?;
    let table: toml::Table = text
        .parse()
        .map_err(|e| bad(format!("not valid TOML: {e}")))?;
    let mut flags = Vec::new();
    for (key, value) in table {
        let flag = format!("--{}", key.replace('_', "-"));
        if flag == "--config" {
            return Err(bad(format!(
                "{key} = {value}: a config file cannot name another; put its settings in this one"
            )));
        }
        match (is_switch(&flag), value) {
            // An unknown flag set to a boolean is passed on as a switch, for the parser to name.
            (None, toml::Value::Boolean(_)) => flags.push((flag, None)),
            (Some(true), toml::Value::Boolean(true)) => flags.push((flag, None)),
            (Some(true), toml::Value::Boolean(false)) => {}
            (Some(true), other) => {
                return Err(bad(format!(
                    "{key} = {other}: {flag} is a switch, set to true or false"
                )))
            }
            (Some(false), toml::Value::Boolean(b)) => {
                return Err(bad(format!(
                    "{key} = {b}: {flag} takes a value, not true or false"
                )))
            }
            (_, value) => push_value(&mut flags, &key, flag, value).map_err(bad)?,
        }
    }
    Ok(flags)
}

/// The flag `flag` (from `key`) set to `value`: a string or number once, a list once per entry
/// (`reward = ["exact:answer", "format:[0-9]+"]`); why not, for any other value.
fn push_value(
    flags: &mut Vec<(String, Option<String>)>,
    key: &str,
    flag: String,
    value: toml::Value,
) -> std::result::Result<(), String> {
    let scalar = |v: &toml::Value| match v {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        _ => None,
    };
    match value {
        toml::Value::Array(list) => {
            for item in &list {
                let text = scalar(item).ok_or_else(|| {
                    format!("{key} holds {item}: a list of strings or numbers is a repeated flag")
                })?;
                flags.push((flag.clone(), Some(text)));
            }
        }
        other => {
            let text = scalar(&other).ok_or_else(|| {
                format!(
                    "{key} = {other} is not a flag value (use a string, number, boolean or list)"
                )
            })?;
            flags.push((flag, Some(text)));
        }
    }
    Ok(())
}

/// A command line with its config file's flags in it.
#[derive(Debug, Clone, PartialEq)]
pub struct Expanded {
    /// The arguments to parse.
    pub args: Vec<String>,
    /// The config file, if one was given.
    pub file: Option<String>,
    /// The flags the file set (and the command line did not).
    pub from_file: Vec<String>,
}

impl Expanded {
    /// Where the value of `flag` came from, for an error about it: `" (set in FILE)"` when the
    /// config file set it, else empty.
    pub fn origin(&self, flag: &str) -> String {
        match &self.file {
            Some(file) if self.from_file.iter().any(|f| f == flag) => {
                format!(" (set in {file})")
            }
            _ => String::new(),
        }
    }
}

/// `args` with `--config FILE` (after the subcommand) replaced by the file's flags, placed before the
/// typed ones; `is_switch` tells the flags that take no value (see [`flags_from_toml`]).
pub fn expand_config(
    args: Vec<String>,
    is_switch: &dyn Fn(&str) -> Option<bool>,
) -> Result<Expanded> {
    let Some(pos) = args
        .iter()
        .position(|a| a == "--config" || a.starts_with("--config="))
    else {
        return Ok(Expanded {
            args,
            file: None,
            from_file: Vec::new(),
        });
    };
    let (path, consumed) = match args[pos].strip_prefix("--config=") {
        Some(p) => (p.to_string(), 1),
        None => match args.get(pos + 1) {
            Some(p) => (p.clone(), 2),
            None => return Err(TrainError::flag("--config", "", "needs a file")),
        },
    };
    let typed: Vec<String> = args[..pos]
        .iter()
        .chain(&args[pos + consumed..])
        .cloned()
        .collect();
    let is_typed = |flag: &str| {
        typed
            .iter()
            .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
    };
    // Program name and subcommand first, then the file's flags not typed, then everything typed.
    let head = 2.min(typed.len());
    let mut out: Vec<String> = typed[..head].to_vec();
    let mut from_file = Vec::new();
    for (flag, value) in flags_from_toml(Path::new(&path), is_switch)? {
        if !is_typed(&flag) {
            out.push(flag.clone());
            out.extend(value);
            from_file.push(flag);
        }
    }
    out.extend(typed[head..].iter().cloned());
    Ok(Expanded {
        args: out,
        file: Some(path),
        from_file,
    })
}
