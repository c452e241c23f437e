//! Shared helpers of the model crate's tests.

#![allow(unused_imports)]

pub use streambp_testkit::*;
