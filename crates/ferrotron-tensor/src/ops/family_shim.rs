//! TEMPORARY scalar kernels (replaced by the family-kernels branch at merge).
use super::activation::{swiglu_packed, swiglu_packed_backward};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActivationFunc {
    Silu,
    Gelu,
    GeluTanh,
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;

impl ActivationFunc {
    pub fn forward(self, x: f32) -> f32 {
        match self {
            ActivationFunc::Silu => x / (1.0 + (-x).exp()),
            ActivationFunc::Gelu => {
                0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2))
            }
            ActivationFunc::GeluTanh => {
                0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
            }
        }
    }
    pub fn derivative(self, x: f32) -> f32 {
        match self {
            ActivationFunc::Silu => {
                let s = 1.0 / (1.0 + (-x).exp());
                s * (1.0 + x * (1.0 - s))
            }
            ActivationFunc::Gelu => {
                let cdf = 0.5 * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2));
                let pdf = (-0.5 * x * x).exp() * 0.398_942_3;
                cdf + x * pdf
            }
            ActivationFunc::GeluTanh => {
                let inner = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
                let t = inner.tanh();
                0.5 * (1.0 + t)
                    + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x)
            }
        }
    }
}

pub fn activation(f: ActivationFunc, x: &[f32], out: &mut [f32]) {
    out.iter_mut().zip(x).for_each(|(o, &x)| *o = f.forward(x));
}
pub fn activation_backward(f: ActivationFunc, x: &[f32], dout: &[f32], dx: &mut [f32]) {
    dx.iter_mut()
        .zip(x)
        .zip(dout)
        .for_each(|((d, &x), &g)| *d = g * f.derivative(x));
}
pub fn glu_packed(f: ActivationFunc, fc1: &[f32], out: &mut [f32], ffn: usize) {
    if f == ActivationFunc::Silu {
        return swiglu_packed(fc1, out, ffn);
    }
    for (o, row) in out.chunks_exact_mut(ffn).zip(fc1.chunks_exact(2 * ffn)) {
        let (g, u) = row.split_at(ffn);
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = f.forward(g) * u;
        }
    }
}
pub fn glu_packed_backward(
    f: ActivationFunc,
    fc1: &[f32],
    dact: &[f32],
    dfc1: &mut [f32],
    ffn: usize,
) {
    if f == ActivationFunc::Silu {
        return swiglu_packed_backward(fc1, dact, dfc1, ffn);
    }
    for ((d, row), da) in dfc1
        .chunks_exact_mut(2 * ffn)
        .zip(fc1.chunks_exact(2 * ffn))
        .zip(dact.chunks_exact(ffn))
    {
        let (g, u) = row.split_at(ffn);
        let (dg, du) = d.split_at_mut(ffn);
        for i in 0..ffn {
            dg[i] = da[i] * u[i] * f.derivative(g[i]);
            du[i] = da[i] * f.forward(g[i]);
        }
    }
}
#[allow(clippy::too_many_arguments)]
pub fn layer_norm(
    x: &[f32],
    h: usize,
    weight: Option<&[f32]>,
    bias: Option<&[f32]>,
    eps: f32,
    out: &mut [f32],
    stats: Option<(&mut [f32], &mut [f32])>,
) {
    let rows = x.len() / h;
    let mut m = vec![0f32; rows];
    let mut r = vec![0f32; rows];
    for (i, (xr, or)) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)).enumerate() {
        let mean = xr.iter().sum::<f32>() / h as f32;
        let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / h as f32;
        let rstd = 1.0 / (var + eps).sqrt();
        for j in 0..h {
            let mut y = (xr[j] - mean) * rstd;
            if let Some(w) = weight {
                y *= w[j];
            }
            if let Some(b) = bias {
                y += b[j];
            }
            or[j] = y;
        }
        m[i] = mean;
        r[i] = rstd;
    }
    if let Some((ms, rs)) = stats {
        ms.copy_from_slice(&m);
        rs.copy_from_slice(&r);
    }
}
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward(
    x: &[f32],
    h: usize,
    weight: Option<&[f32]>,
    mean: &[f32],
    rstd: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    mut dweight: Option<&mut [f32]>,
    mut dbias: Option<&mut [f32]>,
) {
    for (i, ((xr, dyr), dxr)) in x
        .chunks_exact(h)
        .zip(dy.chunks_exact(h))
        .zip(dx.chunks_exact_mut(h))
        .enumerate()
    {
        let (m, r) = (mean[i], rstd[i]);
        let mut s1 = 0f32;
        let mut s2 = 0f32;
        for j in 0..h {
            let xh = (xr[j] - m) * r;
            let g = dyr[j] * weight.map_or(1.0, |w| w[j]);
            s1 += g;
            s2 += g * xh;
            if let Some(dw) = dweight.as_deref_mut() {
                dw[j] += dyr[j] * xh;
            }
            if let Some(db) = dbias.as_deref_mut() {
                db[j] += dyr[j];
            }
        }
        for j in 0..h {
            let xh = (xr[j] - m) * r;
            let g = dyr[j] * weight.map_or(1.0, |w| w[j]);
            dxr[j] = r * (g - s1 / h as f32 - xh * s2 / h as f32);
        }
    }
}
