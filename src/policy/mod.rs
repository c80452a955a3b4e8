//! What to count for one request: the configuration compiled once into a
//! [`plan::Plan`] (matchers, key parts, tiers and limits resolved at
//! configure time), and its evaluation against a [`request::RequestInfo`]
//! ([`evaluate`]): which rules match ([`matcher`]), which bucket each one
//! charges ([`key`] builds the client's key and its hash), and which global
//! buckets and quotas go to the gateway; [`policy_list`] the rules' own
//! limits as `RateLimit-Policy` text, written once. Pure and allocation-light: the hot
//! path of every request starts here.

pub mod evaluate;
pub mod fields;
pub mod json;
pub mod key;
pub mod matcher;
pub mod plan;
pub mod policy_list;
pub mod request;
