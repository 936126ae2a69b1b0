//! `GptModel::expand_vocab` on tiny-llama (untied embedding and output layer): new rows are
//! the means of their pieces' rows, padding rows the mean of all old rows, old logits stay,
//! and bad requests are named.

use ferrotron_model::families::load_hf_model;
use ferrotron_model::{GptModel, KvCache, LogitsMode, NewToken};
use ferrotron_tensor::DType;
use std::path::PathBuf;

fn tiny() -> GptModel {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-llama");
    load_hf_model(&dir, DType::F32).unwrap().0
}

fn row(table: &[f32], h: usize, r: usize) -> &[f32] {
    &table[r * h..(r + 1) * h]
}

#[test]
fn new_rows_are_piece_means_and_old_logits_stay() {
    let old = tiny();
    let (v, h) = (old.config().vocab_size, old.config().hidden_size);
    let new_tokens = [
        NewToken {
            id: 112,
            pieces: vec![5, 7],
        },
        NewToken {
            id: 113,
            pieces: vec![9],
        },
    ];
    let new = old.expand_vocab(120, &new_tokens).unwrap();
    assert_eq!(new.config().vocab_size, 120);
    let names = ["embedding.word_embeddings.weight", "output_layer.weight"];
    for name in names {
        let i = old
            .parameters()
            .iter()
            .position(|p| p.name == name)
            .unwrap();
        let (a, b) = (old.parameter_f32(i).unwrap(), new.parameter_f32(i).unwrap());
        assert_eq!(b[..v * h], a[..], "{name}: old rows kept");
        for j in 0..h {
            let mean = (row(&a, h, 5)[j] as f64 + row(&a, h, 7)[j] as f64) / 2.0;
            assert_eq!(row(&b, h, 112)[j], mean as f32, "{name}[112][{j}]");
        }
        assert_eq!(row(&b, h, 113), row(&a, h, 9));
        for r in 114..120 {
            for j in 0..h {
                let mean = (0..v).map(|k| row(&a, h, k)[j] as f64).sum::<f64>() / v as f64;
                assert_eq!(row(&b, h, r)[j], mean as f32, "{name}: padding row {r}");
            }
        }
    }
    let ids: Vec<u32> = (0..20).map(|i| 3 + i * 5 % 100).collect();
    let logits = |m: &GptModel| {
        let mut cache = KvCache::new(m.config(), 1, ids.len()).unwrap();
        m.forward(&ids, &mut cache, LogitsMode::Last).unwrap()
    };
    let (a, b) = (logits(&old), logits(&new));
    let diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(diff <= 1e-6, "{diff}");
}

#[test]
fn bad_expansions_are_named() {
    let m = tiny();
    let err = |v: usize, t: NewToken| m.expand_vocab(v, &[t]).unwrap_err().to_string();
    let ok = NewToken {
        id: 112,
        pieces: vec![1],
    };
    assert!(err(100, ok.clone()).contains("smaller than the model's (112)"));
    assert!(err(112, ok).contains("new token id 112 is outside"));
    assert!(
        err(
            113,
            NewToken {
                id: 112,
                pieces: vec![]
            }
        )
        .contains("new token 112")
    );
    assert!(
        err(
            113,
            NewToken {
                id: 112,
                pieces: vec![112]
            }
        )
        .contains("< 112")
    );
}
