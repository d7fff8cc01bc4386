//! Helpers shared by the cache plugin's integration tests (`mod support;`).
#![allow(dead_code)]

pub mod redis_server;
