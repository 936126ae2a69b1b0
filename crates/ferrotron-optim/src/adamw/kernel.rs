//! The fused AdamW element loop (formula in the parent module docs).

use std::ops::Range;

use ferrotron_tensor::Element;
use rayon::prelude::*;

use super::AdamWConfig;
use crate::buffer::ParamElement;

/// Elements per parallel work item of the fused update.
const CHUNK: usize = 16 * 1024;

/// Step scalars, computed once per parameter in f64 and rounded to f32 like torch.
#[derive(Clone, Copy)]
pub(super) struct Consts {
    /// `1 - lr*wd` (exactly 1.0 when wd == 0, where torch skips the multiply: same bits).
    decay: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    bias_correction2_sqrt: f32,
    neg_step_size: f32,
    eps: f32,
    /// The clip coefficient each gradient is multiplied by first (1.0: not clipping).
    grad_scale: f32,
}

impl Consts {
    pub(super) fn new(config: &AdamWConfig, step: u64, lr: f64, wd: f64, grad_scale: f32) -> Self {
        let t = step as f64;
        let bias_correction1 = 1.0 - config.beta1.powf(t);
        let bias_correction2 = 1.0 - config.beta2.powf(t);
        Consts {
            decay: if wd != 0.0 {
                (1.0 - lr * wd) as f32
            } else {
                1.0
            },
            one_minus_beta1: (1.0 - config.beta1) as f32,
            beta2: config.beta2 as f32,
            one_minus_beta2: (1.0 - config.beta2) as f32,
            bias_correction2_sqrt: bias_correction2.sqrt() as f32,
            neg_step_size: (-(lr / bias_correction1)) as f32,
            eps: config.eps as f32,
            grad_scale,
        }
    }
}

struct Work<'a, T> {
    p: &'a mut [T],
    g: &'a [f32],
    master: Option<&'a mut [f32]>,
    m: &'a mut [f32],
    v: &'a mut [f32],
    k: Consts,
}

fn take_front<'a, E>(s: &mut &'a mut [E], n: usize) -> &'a mut [E] {
    let (head, tail) = std::mem::take(s).split_at_mut(n);
    *s = tail;
    head
}

/// The not-yet-carved rest of a range's slices.
struct Cursor<'a, T> {
    p: &'a mut [T],
    g: &'a [f32],
    master: Option<&'a mut [f32]>,
    m: &'a mut [f32],
    v: &'a mut [f32],
}

impl<'a, T> Cursor<'a, T> {
    /// Splits the next `n` elements off every slice.
    fn take(&mut self, n: usize, k: Consts) -> Work<'a, T> {
        let (g, g_rest) = self.g.split_at(n);
        self.g = g_rest;
        Work {
            p: take_front(&mut self.p, n),
            g,
            master: self.master.as_mut().map(|s| take_front(s, n)),
            m: take_front(&mut self.m, n),
            v: take_front(&mut self.v, n),
            k,
        }
    }
}

/// Carves the range slices into per-piece chunks and runs them in parallel.
pub(super) fn run<T: ParamElement>(
    p: &mut [T],
    g: &[f32],
    master: Option<&mut [f32]>,
    m: &mut [f32],
    v: &mut [f32],
    pieces: &[(Range<usize>, Consts)],
) {
    let mut cursor = Cursor { p, g, master, m, v };
    let mut work = Vec::new();
    let mut pos = 0;
    for (r, k) in pieces {
        if r.start > pos {
            cursor.take(r.start - pos, *k); // padding between params: skipped
        }
        let mut at = r.start;
        while at < r.end {
            let n = CHUNK.min(r.end - at);
            work.push(cursor.take(n, *k));
            at += n;
        }
        pos = r.end;
    }
    work.into_par_iter().for_each(kernel);
}

ferrotron_tensor::multiversion! {
    /// The fused AdamW update of one chunk (see the module docs for the formula), compiled
    /// for AVX-512, AVX2+FMA and baseline (the same bits: `mul_add` is a fused multiply-add
    /// on every path). torch's CPU kernels (vectorized, built with FMA contraction) compute
    /// `exp_avg.lerp_(g, 1-beta1)` as `fma(1-beta1, g - m, m)` and
    /// `exp_avg_sq.addcmul_(g, g, 1-beta2)` as `fma((1-beta2)*g, g, v*beta2)`; we do the same
    /// and match torch.optim.AdamW bit for bit (tests/adamw.rs).
    fn kernel<T: Element>(w: Work<'_, T>) {
        let k = w.k;
        let update = |weight: f32, g: f32, m: &mut f32, v: &mut f32| -> f32 {
            let g = g * k.grad_scale;
            let weight = weight * k.decay;
            *m = k.one_minus_beta1.mul_add(g - *m, *m);
            *v = (k.one_minus_beta2 * g).mul_add(g, *v * k.beta2);
            let denom = v.sqrt() / k.bias_correction2_sqrt + k.eps;
            weight + k.neg_step_size * *m / denom
        };
        let iter =
            w.p.iter_mut()
                .zip(w.g)
                .zip(w.m.iter_mut().zip(w.v.iter_mut()));
        match w.master {
            Some(master) => {
                for (((p, &g), (m, v)), mw) in iter.zip(master.iter_mut()) {
                    *mw = update(*mw, g, m, v);
                    *p = T::from_f32(*mw);
                }
            }
            None => {
                for ((p, &g), (m, v)) in iter {
                    *p = T::from_f32(update(p.to_f32(), g, m, v));
                }
            }
        }
    }
}
