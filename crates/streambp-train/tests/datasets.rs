//! Data the way TRL users have it: Parquet files (written here with the `parquet` crate, in the
//! layout `datasets` writes: strings, and conversations as lists of `{content, role}` structs), JSON
//! arrays, directories of shards and hub dataset ids read offline from the hub cache, give exactly the
//! examples the same rows give as JSONL; errors name the shard and row.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::{arithmetic_tokenizer_with_template, msg, sft_examples, sft_file};
use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;
use serde_json::{json, Value};
use streambp_train::data::{load_sft, Overflow};
use streambp_train::dataset::DataSource;
use streambp_train::recipes::pairs::load_pairs;
use streambp_train::tokenizer::TextTokenizer;

/// A column's Parquet type: `datasets`' for a string, or for a list of messages.
fn column_schema(name: &str, rows: &[Value]) -> String {
    let conversation = rows.iter().any(|r| r[name].is_array());
    match conversation {
        true => format!(
            "optional group {name} (LIST) {{ repeated group list {{ optional group element {{ \
             optional binary content (STRING); optional binary role (STRING); }} }} }}"
        ),
        false => format!("optional binary {name} (STRING);"),
    }
}

/// Writes `rows` (objects whose values are strings or lists of messages) as a Parquet file with
/// `columns`, `rows_per_group` rows in each row group (so reading crosses row groups), snappy.
fn write_parquet(path: &Path, columns: &[&str], rows: &[Value], rows_per_group: usize) {
    write_compressed(path, columns, rows, rows_per_group, Compression::SNAPPY);
}

/// [`write_parquet`] with the codec `compression`.
fn write_compressed(
    path: &Path,
    columns: &[&str],
    rows: &[Value],
    rows_per_group: usize,
    compression: Compression,
) {
    let fields: Vec<String> = columns.iter().map(|c| column_schema(c, rows)).collect();
    let schema = parse_message_type(&format!("message schema {{ {} }}", fields.join(" "))).unwrap();
    let props = WriterProperties::builder()
        .set_compression(compression)
        .build();
    let file = std::fs::File::create(path).unwrap();
    let mut writer = SerializedFileWriter::new(file, Arc::new(schema), Arc::new(props)).unwrap();
    for group in rows.chunks(rows_per_group) {
        let mut row_group = writer.next_row_group().unwrap();
        // Leaves in schema order: a string column is one; a conversation two (content, role).
        let leaves: Vec<(&str, Option<&str>)> = columns
            .iter()
            .flat_map(|c| match rows.iter().any(|r| r[*c].is_array()) {
                true => vec![(*c, Some("content")), (*c, Some("role"))],
                false => vec![(*c, None)],
            })
            .collect();
        for (column, key) in leaves {
            let (mut values, mut defs, mut reps) = (Vec::new(), Vec::new(), Vec::new());
            for row in group {
                match (&row[column], key) {
                    (Value::Null, _) => {
                        defs.push(0);
                        reps.push(0);
                    }
                    (Value::String(s), None) => {
                        values.push(ByteArray::from(s.as_str()));
                        defs.push(1);
                    }
                    (Value::Array(messages), Some(key)) => {
                        if messages.is_empty() {
                            defs.push(1);
                            reps.push(0);
                        }
                        for (i, m) in messages.iter().enumerate() {
                            values.push(ByteArray::from(m[key].as_str().unwrap()));
                            defs.push(4);
                            reps.push(i16::from(i > 0));
                        }
                    }
                    (other, _) => panic!("{column}: unsupported test value {other}"),
                }
            }
            let mut col = row_group.next_column().unwrap().unwrap();
            let reps = key.map(|_| reps.as_slice());
            col.typed::<ByteArrayType>()
                .write_batch(&values, Some(&defs), reps)
                .unwrap();
            col.close().unwrap();
        }
        row_group.close().unwrap();
    }
    writer.close().unwrap();
}

fn write_jsonl(path: &Path, rows: &[Value]) {
    let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
    std::fs::write(path, text).unwrap();
}

/// A tokenizer whose template renders `user` turns as `content=` and the rest as they are.
fn tokenizer(dir: &Path) -> TextTokenizer {
    let template = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}={% else %}{{ m['content'] }}{% endif %}{% endfor %}";
    arithmetic_tokenizer_with_template(dir, template)
}

#[test]
fn parquet_and_json_arrays_give_the_examples_jsonl_gives() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer(&dir.path().join("tok"));
    let chat = |q: &str, a: &str| json!([msg("user", q), msg("assistant", a)]);
    // SFT, each of TRL's formats.
    let formats: [(&str, Vec<&str>, Vec<Value>); 4] = [
        (
            "messages",
            vec!["messages"],
            (0..7)
                .map(|i| json!({"messages": chat(&format!("{i}+1"), &format!("{}", i + 1))}))
                .collect(),
        ),
        (
            "prompt-completion",
            vec!["prompt", "completion"],
            (0..7)
                .map(|i| json!({"prompt": format!("{i}+2="), "completion": format!("{}", i + 2)}))
                .collect(),
        ),
        (
            "conversational prompt-completion",
            vec!["prompt", "completion"],
            (0..7)
                .map(|i| {
                    json!({"prompt": [msg("user", &format!("{i}+3"))],
                           "completion": [msg("assistant", &format!("{}", i + 3))]})
                })
                .collect(),
        ),
        (
            "text",
            vec!["text"],
            (0..7)
                .map(|i| json!({"text": format!("{i}+4={}", i + 4)}))
                .collect(),
        ),
    ];
    for (name, columns, rows) in &formats {
        let jsonl = dir.path().join(format!("{name}.jsonl"));
        let parquet = dir.path().join(format!("{name}.parquet"));
        let array = dir.path().join(format!("{name}.json"));
        write_jsonl(&jsonl, rows);
        write_parquet(&parquet, columns, rows, 3);
        std::fs::write(&array, Value::from(rows.clone()).to_string()).unwrap();
        let expected = sft_file(&jsonl, &tok).unwrap();
        assert_eq!(expected.len(), 7, "{name}");
        for other in [&parquet, &array] {
            let got = sft_file(other, &tok).unwrap();
            assert_eq!(got, expected, "{name}: {}", other.display());
        }
    }

    // DPO: explicit prompts, conversations, and prompts implicit in both sides (strings, and
    // conversations beside a string `prompt` column, as in ultrafeedback_binarized).
    let pair_formats: [(&str, Vec<&str>, Vec<Value>); 3] = [
        (
            "explicit",
            vec!["prompt", "chosen", "rejected"],
            (0..5)
                .map(|i| json!({"prompt": format!("{i}+1="), "chosen": format!("{}", i + 1), "rejected": "0"}))
                .collect(),
        ),
        (
            "implicit strings",
            vec!["chosen", "rejected"],
            (0..5)
                .map(|i| json!({"chosen": format!("{i}+1={}", i + 1), "rejected": format!("{i}+1=0")}))
                .collect(),
        ),
        (
            "implicit conversations",
            vec!["prompt", "chosen", "rejected"],
            (0..5)
                .map(|i| {
                    json!({"prompt": format!("{i}+1"),
                           "chosen": chat(&format!("{i}+1"), &format!("{}", i + 1)),
                           "rejected": chat(&format!("{i}+1"), "0")})
                })
                .collect(),
        ),
    ];
    for (name, columns, rows) in &pair_formats {
        let jsonl = dir.path().join(format!("pairs {name}.jsonl"));
        let parquet = dir.path().join(format!("pairs {name}.parquet"));
        write_jsonl(&jsonl, rows);
        write_parquet(&parquet, columns, rows, 2);
        let load = |path: &Path| {
            load_pairs(&DataSource::file(path).unwrap(), &tok, 64, Overflow::Skip).unwrap()
        };
        let (expected, got) = (load(&jsonl), load(&parquet));
        assert_eq!(expected.len(), 5);
        for (e, g) in expected.iter().zip(&got) {
            assert_eq!((&e.chosen, &e.rejected), (&g.chosen, &g.rejected), "{name}");
        }
        // The prompt is where the two sides part: "i+1=" for every format.
        let first = &expected[1];
        let prompt_len = first
            .chosen
            .labels
            .iter()
            .take_while(|&&l| l == -100)
            .count();
        assert_eq!(
            tok.decode(&first.chosen.input_ids[..prompt_len]).unwrap(),
            "1+1=",
            "{name}"
        );
        assert_eq!(
            tok.decode(&first.rejected.input_ids[prompt_len..])
                .unwrap()
                .replace("<eos>", ""),
            "0",
            "{name}"
        );
    }
}

/// Text in BINARY columns without the STRING annotation (what several writers produce) is read as
/// text, not as its base64; bytes that are not UTF-8 (an image column beside the text) read as null
/// and are no obstacle to the columns the loader reads.
#[test]
fn unannotated_binary_columns_are_text() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer(&dir.path().join("tok"));
    let rows = rows(5, 0);
    let jsonl = dir.path().join("text.jsonl");
    write_jsonl(&jsonl, &rows);
    let parquet = dir.path().join("binary.parquet");
    let schema = parse_message_type(
        "message schema { required binary prompt; required binary completion; required binary image; }",
    )
    .unwrap();
    let file = std::fs::File::create(&parquet).unwrap();
    let mut writer = SerializedFileWriter::new(
        file,
        Arc::new(schema),
        Arc::new(WriterProperties::default()),
    )
    .unwrap();
    let mut group = writer.next_row_group().unwrap();
    let image: Vec<u8> = vec![0x89, b'P', b'N', b'G', 0xff, 0xfe];
    for column in ["prompt", "completion", "image"] {
        let values: Vec<ByteArray> = rows
            .iter()
            .map(|r| match column {
                "image" => ByteArray::from(image.clone()),
                _ => ByteArray::from(r[column].as_str().unwrap()),
            })
            .collect();
        let mut col = group.next_column().unwrap().unwrap();
        col.typed::<ByteArrayType>()
            .write_batch(&values, None, None)
            .unwrap();
        col.close().unwrap();
    }
    group.close().unwrap();
    writer.close().unwrap();
    assert_eq!(
        sft_file(&parquet, &tok).unwrap(),
        sft_file(&jsonl, &tok).unwrap()
    );
    let source = DataSource::file(&parquet).unwrap();
    let first = source.rows().next().unwrap().unwrap().1;
    assert_eq!(first["prompt"], json!("0+1="));
    assert_eq!(first["image"], Value::Null);
}

/// A UTF-8 byte-order mark before a JSONL file's first line or a JSON array is skipped, as Python's
/// readers skip it: the same examples as the file without one.
#[test]
fn a_byte_order_mark_is_not_data() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer(&dir.path().join("tok"));
    let rows = rows(4, 0);
    let plain = dir.path().join("plain.jsonl");
    write_jsonl(&plain, &rows);
    let expected = sft_file(&plain, &tok).unwrap();
    let jsonl: String = rows.iter().map(|r| format!("{r}\n")).collect();
    for (name, text) in [
        ("bom.jsonl", jsonl),
        ("bom.json", Value::from(rows.clone()).to_string()),
    ] {
        let path = dir.path().join(name);
        std::fs::write(&path, format!("\u{feff}{text}")).unwrap();
        assert_eq!(sft_file(&path, &tok).unwrap(), expected, "{name}");
    }
}

/// `data/<split>-NNNNN-of-NNNNN.parquet` shards of `rows`, as `push_to_hub` lays them out.
fn write_sharded(root: &Path, split: &str, rows: &[Value], shards: usize) {
    std::fs::create_dir_all(root.join("data")).unwrap();
    let per = rows.len().div_ceil(shards);
    for (i, part) in rows.chunks(per).enumerate() {
        let name = format!("data/{split}-{i:05}-of-{shards:05}.parquet");
        write_parquet(&root.join(name), &["prompt", "completion"], part, 2);
    }
}

fn rows(n: usize, offset: usize) -> Vec<Value> {
    (0..n)
        .map(|i| json!({"prompt": format!("{}+1=", i + offset), "completion": format!("{}", i + offset + 1)}))
        .collect()
}

#[test]
fn directories_and_hub_ids_resolve_their_splits_offline() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer(&dir.path().join("tok"));
    let (train, test) = (rows(9, 0), rows(4, 50));
    let expected = |rows: &[Value]| {
        let file = dir.path().join("expected.jsonl");
        write_jsonl(&file, rows);
        sft_file(&file, &tok).unwrap()
    };
    let (train_examples, test_examples) = (expected(&train), expected(&test));

    // A local directory of shards.
    let local = dir.path().join("local");
    write_sharded(&local, "train", &train, 2);
    write_sharded(&local, "test", &test, 1);
    std::fs::write(local.join("README.md"), "# a data set\n").unwrap();
    let source = DataSource::resolve(&local, "train", None).unwrap();
    assert_eq!(source.shards().len(), 2);
    assert_eq!(sft_examples(&source, &tok).unwrap(), train_examples);
    let source = DataSource::resolve(&local, "test", None).unwrap();
    assert_eq!(sft_examples(&source, &tok).unwrap(), test_examples);

    // The same files as the hub cache holds a dataset's snapshot, read with HF_HUB_OFFLINE=1.
    let home = dir.path().join("hf-home");
    let repo = home.join("hub/datasets--someone--arith");
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "0123abcd").unwrap();
    let snapshot = repo.join("snapshots/0123abcd");
    write_sharded(&snapshot, "train", &train, 3);
    write_sharded(&snapshot, "test", &test, 1);
    std::env::set_var("HF_HOME", &home);
    std::env::set_var("HF_HUB_OFFLINE", "1");
    let id = Path::new("someone/arith");
    let source = DataSource::resolve(id, "train", None).unwrap();
    assert_eq!(source.shards().len(), 3);
    assert_eq!(sft_examples(&source, &tok).unwrap(), train_examples);
    let source = DataSource::resolve(id, "test", None).unwrap();
    assert_eq!(sft_examples(&source, &tok).unwrap(), test_examples);
    let err = DataSource::resolve(id, "validation", None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no split \"validation\" (splits found: \"test\", \"train\")"),
        "{err}"
    );
    let err = DataSource::resolve(Path::new("someone/other"), "train", None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("not in the hub cache") && err.contains("HF_HUB_OFFLINE"),
        "{err}"
    );
}

#[test]
fn errors_name_the_shard_and_row() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer(&dir.path().join("tok"));
    let mut bad = rows(6, 0);
    bad[4]["completion"] = Value::Null;
    let file = dir.path().join("bad.parquet");
    write_parquet(&file, &["prompt", "completion"], &bad, 2);
    let err = sft_file(&file, &tok).unwrap_err().to_string();
    assert!(err.contains("bad.parquet row 4: expected"), "{err}");

    let corrupt = dir.path().join("corrupt.parquet");
    std::fs::write(&corrupt, b"PAR1 this is not parquet").unwrap();
    let err = sft_file(&corrupt, &tok).unwrap_err().to_string();
    assert!(
        err.contains("corrupt.parquet: not a readable Parquet file"),
        "{err}"
    );

    let array = dir.path().join("rows.json");
    std::fs::write(&array, r#"[{"text": "1+1=2"}, 7]"#).unwrap();
    let err = sft_file(&array, &tok).unwrap_err().to_string();
    assert!(
        err.contains("rows.json row 1: expected a JSON object"),
        "{err}"
    );
    // A JSON array is read element by element: a syntax error names the row it broke in.
    std::fs::write(
        &array,
        r#"[{"text": "1+1=2"}, {"text": "2+2=4"}, {"text": 3+]"#,
    )
    .unwrap();
    let err = sft_file(&array, &tok).unwrap_err().to_string();
    assert!(
        err.contains("rows.json: not a valid JSON array (at row 2)") && err.contains("column"),
        "{err}"
    );

    // --dataset-text-field names the column plain rows train on.
    let body = dir.path().join("body.jsonl");
    write_jsonl(&body, &[json!({"body": "1+1=2"})]);
    let source = DataSource::file(&body).unwrap();
    let err = sft_examples(&source, &tok).unwrap_err().to_string();
    assert!(
        err.contains("body.jsonl line 1") && err.contains("--dataset-text-field"),
        "{err}"
    );
    let examples = load_sft(&source, &tok, 64, Overflow::Truncate, "body").unwrap();
    assert_eq!(
        tok.decode(&examples[0].input_ids)
            .unwrap()
            .replace("<eos>", ""),
        "1+1=2"
    );
}

/// GRPO reads its prompts and reward columns from Parquet as from JSONL: the same short run (seeded
/// rollouts) gives the same losses and rewards step by step.
#[test]
fn grpo_trains_on_parquet_prompts_as_on_jsonl() {
    use streambp_train::config::{GrpoConfig, Recipe, TrainConfig};
    let dir = tempfile::tempdir().unwrap();
    let rows: Vec<Value> = (0..8)
        .map(|i| json!({"prompt": format!("{i}+{}=", i + 3), "answer": format!("{}", 2 * i + 3)}))
        .collect();
    let (jsonl, parquet) = (dir.path().join("p.jsonl"), dir.path().join("p.parquet"));
    write_jsonl(&jsonl, &rows);
    write_parquet(&parquet, &["prompt", "answer"], &rows, 3);
    let run = |data: &Path, out: &str| -> Vec<Value> {
        let cfg = TrainConfig {
            output_dir: dir.path().join(out),
            data: Some(data.to_path_buf()),
            max_steps: Some(2),
            batch_size: 4,
            seed: 1,
            progress: false,
            ..TrainConfig::defaults(Recipe::Grpo, false)
        };
        let g = GrpoConfig {
            rewards: vec!["exact:answer".into(), "format:[0-9]+".into()],
            ..GrpoConfig::defaults(false)
        };
        streambp_train::grpo::run_grpo(&cfg, &g).unwrap();
        std::fs::read_to_string(dir.path().join(out).join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|r| r.get("loss").is_some())
            .collect()
    };
    let (a, b) = (run(&jsonl, "jsonl"), run(&parquet, "parquet"));
    assert_eq!(a.len(), 2);
    for (x, y) in a.iter().zip(&b) {
        for key in ["loss", "reward", "grad_norm", "completion_length"] {
            assert_eq!(x[key], y[key], "{key}: {x} vs {y}");
        }
    }
}

/// Every codec writers use (pandas' and `datasets`' snappy, zstd, gzip, brotli, lz4, none) reads as
/// the same rows.
#[test]
fn every_parquet_codec_reads_the_same_rows() {
    use parquet::basic::{BrotliLevel, GzipLevel, ZstdLevel};
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer(&dir.path().join("tok"));
    let rows: Vec<Value> = (0..5)
        .map(|i| json!({"prompt": format!("{i}+2="), "completion": format!("{}", i + 2)}))
        .collect();
    let jsonl = dir.path().join("rows.jsonl");
    write_jsonl(&jsonl, &rows);
    let expected = sft_file(&jsonl, &tok).unwrap();
    for codec in [
        Compression::UNCOMPRESSED,
        Compression::SNAPPY,
        Compression::ZSTD(ZstdLevel::default()),
        Compression::GZIP(GzipLevel::default()),
        Compression::BROTLI(BrotliLevel::default()),
        Compression::LZ4_RAW,
        Compression::LZ4,
    ] {
        let path = dir.path().join(format!("{codec}.parquet"));
        write_compressed(&path, &["prompt", "completion"], &rows, 2, codec);
        let got = sft_file(&path, &tok).unwrap_or_else(|e| panic!("{codec}: {e}"));
        assert_eq!(got, expected, "{codec}");
    }
}
