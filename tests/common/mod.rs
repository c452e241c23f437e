//! Helpers shared by this crate's tests.

#![allow(unused_imports)]

pub use streambp_testkit::*;
