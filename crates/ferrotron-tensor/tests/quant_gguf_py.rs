//! `quant::dequantize` against gguf-py's `quants.dequantize` on random blocks of every format
//! (`fixtures/quant/gguf_py_blocks.json`, written by `tools/make_quant_fixture.py`): bit for bit.

use ferrotron_tensor::quant::{QuantMatrix, QuantType, dequantize};

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

#[test]
fn dequantize_is_bit_identical_to_gguf_py() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../fixtures/quant/gguf_py_blocks.json"
    );
    let text = std::fs::read_to_string(path).expect("fixture");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    for ty in QuantType::ALL {
        let t = &v["types"][ty.name()];
        let bytes = hex(t["bytes"].as_str().expect("bytes"));
        let want: Vec<u32> = t["value_bits"]
            .as_array()
            .expect("values")
            .iter()
            .map(|x| x.as_u64().expect("u32") as u32)
            .collect();
        let mut got = vec![0f32; want.len()];
        dequantize(ty, &bytes, &mut got);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                *w,
                "{ty} value {i}: {g} vs {}",
                f32::from_bits(*w)
            );
        }
        // The same bytes as a 2-row matrix dequantize the same way row by row.
        let rows = 2;
        let m = QuantMatrix::new(ty, rows, want.len() / rows, bytes).expect("matrix");
        let mut again = vec![0f32; want.len()];
        m.dequantize_rows(0..rows, &mut again);
        assert_eq!(again, got);
    }
}
