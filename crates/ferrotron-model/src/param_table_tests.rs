//! Tests of [`super::ParamTable`].

use super::*;

fn table() -> ParamTable {
    let a = Tensor::from_f32(&[2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
    let b = Tensor::from_f32(&[2], vec![1.0 + 1.0 / 512.0, -7.0]).unwrap();
    ParamTable::packed(
        vec![a.into(), b.into()],
        DType::BF16,
        &[ParamHome::Trainable; 2],
    )
}

#[test]
fn packing_rounds_to_the_table_dtype() {
    let t = table();
    assert_eq!(t.dtype(), DType::BF16);
    assert_eq!(t.view(0).shape(), &[2, 3]);
    // 1 + 2^-9 is a quarter of a bf16 ulp above 1: it rounds to 1.
    assert_eq!(&*t.f32_values(1), &[1.0, -7.0]);
    assert_eq!(t.storage_bytes(), 8 * 2);
}

#[test]
fn rehome_moves_values_to_the_offsets_and_keeps_the_padding() {
    let mut t = table();
    let mut dst = Storage::zeros(DType::BF16, 12);
    dst.set_from_f32(10..12, &[9.0, 9.0]);
    t.rehome(dst, &[3, 0]).unwrap();
    assert_eq!(&*t.f32_values(0), &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    assert_eq!(&*t.f32_values(1), &[1.0, -7.0]);
    let storage = t.take_storage().unwrap();
    let all = storage.to_f32_range(0..12);
    assert_eq!(all, [1., -7., 0., 1., 2., 3., 4., 5., 6., 0., 9., 9.]);
    t.restore_storage(storage).unwrap();
    assert_eq!(t.view(0).numel(), 6);
}

#[test]
fn bad_layouts_and_lending_errors_leave_the_table_usable() {
    let mut t = table();
    let overlap = t.rehome(Storage::zeros(DType::BF16, 12), &[0, 5]);
    assert!(format!("{}", overlap.unwrap_err()).contains("overlaps"));
    let short = t.rehome(Storage::zeros(DType::BF16, 7), &[0, 6]);
    assert!(format!("{}", short.unwrap_err()).contains("leaves the 7-element storage"));
    let dtype = t.rehome(Storage::zeros(DType::F32, 8), &[0, 6]);
    assert!(dtype.is_err());
    assert_eq!(&*t.f32_values(1), &[1.0, -7.0]);
    let storage = t.take_storage().unwrap();
    assert!(t.take_storage().is_err());
    assert!(t.restore_storage(Storage::zeros(DType::BF16, 3)).is_err());
    t.restore_storage(storage).unwrap();
    assert!(t.restore_storage(Storage::zeros(DType::BF16, 8)).is_err());
    let err = t.set_from_f32(1, "b", &[1.0]).unwrap_err();
    assert!(format!("{err}").contains("b: slice of 1 elements"));
}

#[test]
fn quantized_slots_keep_their_blocks_and_refuse_writes() {
    use ferrotron_tensor::quant::{QuantMatrix, QuantType};
    let a = Tensor::from_f32(&[2], vec![1.0, 2.0]).unwrap();
    // Two Q8_0 rows of 32 values: scale 1.0 (f16 0x3C00), values 0..32.
    let mut bytes = Vec::new();
    for _ in 0..2 {
        bytes.extend([0x00, 0x3C]);
        bytes.extend(0..32u8);
    }
    let q = QuantMatrix::new(QuantType::Q8_0, 2, 32, bytes).unwrap();
    let values = vec![a.into(), ParamValue::Quantized(q)];
    let mut t = ParamTable::packed(values, DType::F32, &[ParamHome::Trainable; 2]);
    assert_eq!(t.storage_bytes(), 2 * 4);
    assert_eq!(t.quantized_bytes(), 2 * 34);
    assert!(matches!(t.view(1).weight_ref(), WeightRef::Quant(_)));
    assert_eq!(t.view(1).shape(), &[2, 32]);
    assert_eq!(t.f32_values(1)[..3], [0.0, 1.0, 2.0]);
    assert_eq!(&*t.f32_values(0), &[1.0, 2.0]);
    let err = t.set_from_f32(1, "w", &[0.0; 64]).unwrap_err();
    assert!(format!("{err}").contains("w: a quantized weight cannot be written"));
    assert!(t.is_frozen(1));
    // The quantized weight stays behind; the dense one moves.
    t.rehome(Storage::zeros(DType::F32, 4), &[2, 0]).unwrap();
    assert_eq!(&*t.f32_values(0), &[1.0, 2.0]);
    assert_eq!(t.f32_values(1)[..3], [0.0, 1.0, 2.0]);
}

#[test]
fn frozen_values_stay_readable_while_the_trainable_storage_is_lent() {
    let a = Tensor::from_f32(&[2], vec![1.0, 2.0]).unwrap();
    let b = Tensor::from_f32(&[3], vec![3.0, 4.0, 5.0]).unwrap();
    let mut t = ParamTable::packed(
        vec![a.into(), b.into()],
        DType::F32,
        &[ParamHome::Frozen, ParamHome::Trainable],
    );
    assert_eq!(t.storage_bytes(), 5 * 4);
    t.rehome(Storage::zeros(DType::F32, 3), &[99, 0]).unwrap();
    let lent = t.take_storage().unwrap();
    assert_eq!(lent.to_f32_range(0..3), [3.0, 4.0, 5.0]);
    assert_eq!(&*t.f32_values(0), &[1.0, 2.0]);
    t.set_from_f32(0, "a", &[7.0, 8.0]).unwrap();
    t.restore_storage(lent).unwrap();
    assert_eq!(&*t.f32_values(0), &[7.0, 8.0]);
    assert_eq!(&*t.f32_values(1), &[3.0, 4.0, 5.0]);
}

/// A buffer keeps f32 in a bf16 table: a step of 1e-3 from 0.5 survives (bf16 would round
/// 0.501 back to 0.5), and it stays with the table while the trainable storage is lent.
#[test]
fn buffers_stay_f32_in_a_bf16_table() {
    let w = Tensor::from_f32(&[2], vec![1.0, 2.0]).unwrap();
    let bias = Tensor::from_f32(&[2], vec![0.5, -0.25]).unwrap();
    let homes = [ParamHome::Trainable, ParamHome::Buffer];
    let mut t = ParamTable::packed(vec![w.into(), bias.into()], DType::BF16, &homes);
    assert_eq!(t.view(1).dtype(), DType::F32);
    assert_eq!(t.view(0).dtype(), DType::BF16);
    assert!(t.is_frozen(1));
    assert_eq!(t.storage_bytes(), 2 * 2 + 2 * 4);
    t.rehome(Storage::zeros(DType::BF16, 2), &[0, 99]).unwrap();
    let lent = t.take_storage().unwrap();
    t.set_from_f32(1, "expert_bias", &[0.501, -0.249]).unwrap();
    assert_eq!(&*t.f32_values(1), &[0.501, -0.249]);
    t.restore_storage(lent).unwrap();
    assert_eq!(&*t.f32_values(0), &[1.0, 2.0]);
    match t.value(1) {
        ParamValue::Dense(v) => assert_eq!(v.dtype(), DType::F32),
        ParamValue::Quantized(_) => panic!("a buffer is dense"),
    }
}
