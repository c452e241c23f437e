//! The layout's rope tables are built once and cut per chunk: every cut must equal the table built for
//! exactly those positions, bit for bit, for plain and packed rows, including after the table grew.

use candle_core::{DType, Device, Tensor};
use streambp_models::config::{RopeConfig, RopeScaling};
use streambp_models::layout::Layout;
use streambp_models::rope::Rotary;

fn assert_same(a: &Tensor, b: &Tensor) {
    let a: Vec<f64> = a.flatten_all().unwrap().to_vec1().unwrap();
    let b: Vec<f64> = b.flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(a, b);
}

#[test]
fn cut_tables_equal_tables_built_for_their_positions() {
    let dev = Device::Cpu;
    let rotary = Rotary::new(
        &RopeConfig {
            theta: 10000.0,
            scaling: RopeScaling::None,
        },
        8,
    );
    let other = Rotary::new(
        &RopeConfig {
            theta: 1e6,
            scaling: RopeScaling::None,
        },
        8,
    );

    // Plain rows: ranges asked in an order that makes the table grow twice.
    let plain = Layout::default();
    for (start, len) in [(0, 3), (2, 4), (5, 20), (0, 1), (40, 7), (19, 1)] {
        for r in [&rotary, &other] {
            let (cos, sin) = plain.rope_tables(r, start, len, DType::F64, &dev).unwrap();
            let positions = (start..start + len).map(|p| p as f64);
            let (want_cos, want_sin) = r.tables(positions, len, DType::F64, &dev).unwrap();
            assert_same(&cos, &want_cos);
            assert_same(&sin, &want_sin);
        }
    }

    // Packed rows: two rows, documents restarting at different places.
    let rows: [[u32; 6]; 2] = [[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]];
    let ids = Tensor::new(&rows, &dev).unwrap();
    let packed = Layout::new(None, Some(&ids)).unwrap();
    for (start, len) in [(0, 6), (1, 3), (4, 2)] {
        let (cos, sin) = packed
            .rope_tables(&rotary, start, len, DType::F64, &dev)
            .unwrap();
        assert_eq!(cos.dims(), [2, 1, len, 8]);
        let positions = rows
            .iter()
            .flat_map(|row| row[start..start + len].iter().map(|&p| p as f64));
        let (want_cos, want_sin) = rotary.tables(positions, 2 * len, DType::F64, &dev).unwrap();
        assert_same(&cos, &want_cos);
        assert_same(&sin, &want_sin);
    }
    assert!(packed.rope_tables(&rotary, 4, 3, DType::F64, &dev).is_err());
}
