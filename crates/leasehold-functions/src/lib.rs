#![doc = include_str!("../README.md")]

pub mod dataverse;
pub mod handler;
pub mod http;
pub mod logic;
pub mod start;
