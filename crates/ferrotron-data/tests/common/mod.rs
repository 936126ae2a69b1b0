//! Shared by the test binaries: the harness of the tests on the real SmolLM2 tokenizer
//! (`weights`).

pub mod weights;
