//! What the tools' binaries (`demo`, `bench`) share.

pub mod children;
