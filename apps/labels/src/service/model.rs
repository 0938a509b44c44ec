//! The published label contract: request and response documents and validation.

use idemkit_core::ErrorCode;
use idemkit_tower::ProblemResponse;
use serde::{Deserialize, Serialize};

/// The couriers the contract accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum CourierName {
    /// YunExpress.
    Yunexpress,
    /// DHL.
    Dhl,
    /// UPS.
    Ups,
}

/// A postal address.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Address {
    /// Addressee.
    #[schema(min_length = 1, max_length = 100)]
    pub name: String,
    /// First address line.
    #[schema(min_length = 1, max_length = 200)]
    pub line1: String,
    /// Second address line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(min_length = 1, max_length = 200)]
    pub line2: Option<String>,
    /// City.
    #[schema(min_length = 1, max_length = 100)]
    pub city: String,
    /// Postal code.
    #[schema(min_length = 1, max_length = 20)]
    pub postal_code: String,
    /// ISO 3166-1 alpha-2 country code, upper case (e.g. `JP`); must be an assigned code.
    #[schema(pattern = "^[A-Z]{2}$", example = "JP")]
    pub country: String,
}

/// The parcel's weight and dimensions.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Parcel {
    /// Weight in grams, > 0.
    #[schema(minimum = 1)]
    pub weight_grams: u64,
    /// Length in centimetres, > 0.
    #[schema(exclusive_minimum = 0)]
    pub length_cm: f64,
    /// Width in centimetres, > 0.
    #[schema(exclusive_minimum = 0)]
    pub width_cm: f64,
    /// Height in centimetres, > 0.
    #[schema(exclusive_minimum = 0)]
    pub height_cm: f64,
}

/// `POST /labels` body.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CreateLabel {
    /// The idempotency key: 1–255 visible ASCII characters, scoped to your account.
    /// Reuse it on every retry of this label; a new label needs a new key.
    #[schema(
        min_length = 1,
        max_length = 255,
        pattern = "^[!-~]+$",
        example = "label-order-4711"
    )]
    pub idempotency_key: String,
    /// Which courier ships it.
    pub courier: CourierName,
    /// Sender.
    pub ship_from: Address,
    /// Recipient.
    pub ship_to: Address,
    /// The parcel.
    pub parcel: Parcel,
}

/// Why a label failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct LabelError {
    /// Machine code (`courier_unavailable`, `address_rejected`, …).
    pub code: String,
    /// What happened.
    pub message: String,
    /// Whether retrying with the same key and body may succeed.
    pub retryable: bool,
}

/// The label document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Label {
    /// Label id.
    pub id: String,
    /// `created` or `failed` (or `pending` while in progress).
    pub status: String,
    /// The courier.
    pub courier: String,
    /// The courier's order number, once created.
    pub courier_order_number: Option<String>,
    /// The courier's tracking number, once created.
    pub courier_tracking_number: Option<String>,
    /// Why it failed, if it did.
    pub error: Option<LabelError>,
}

/// One tracking event.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TrackingEvent {
    /// When (RFC 3339).
    pub at: String,
    /// Machine status.
    pub status: String,
    /// Human description.
    pub description: String,
}

/// `GET /tracking/{id}` answer.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Tracking {
    /// The tracking number.
    pub tracking_number: String,
    /// Events, oldest first.
    pub events: Vec<TrackingEvent>,
}

fn invalid(detail: impl Into<String>) -> ProblemResponse {
    ProblemResponse::new(ErrorCode::ValidationFailed, detail)
}

fn check_text(field: &str, value: &str, max: usize) -> Result<(), ProblemResponse> {
    if value.trim().is_empty() || value.chars().count() > max || value.chars().any(char::is_control) {
        return Err(invalid(format!(
            "`{field}` must be 1 to {max} characters without control characters"
        )));
    }
    Ok(())
}

impl Address {
    fn validate(&self, at: &str) -> Result<(), ProblemResponse> {
        check_text(&format!("{at}.name"), &self.name, 100)?;
        check_text(&format!("{at}.line1"), &self.line1, 200)?;
        if let Some(l2) = &self.line2 {
            check_text(&format!("{at}.line2"), l2, 200)?;
        }
        check_text(&format!("{at}.city"), &self.city, 100)?;
        check_text(&format!("{at}.postalCode"), &self.postal_code, 20)?;
        if !is_iso_country(&self.country) {
            return Err(invalid(format!(
                "`{at}.country` must be an ISO 3166-1 alpha-2 code such as `JP`"
            )));
        }
        Ok(())
    }
}

impl CreateLabel {
    /// Parses and validates a request body (everything but the key, which the
    /// idempotency layer checks).
    pub fn parse(body: &[u8]) -> Result<Self, ProblemResponse> {
        let req: Self =
            serde_json::from_slice(body).map_err(|e| invalid(format!("invalid label request: {e}")))?;
        req.ship_from.validate("shipFrom")?;
        req.ship_to.validate("shipTo")?;
        let p = &req.parcel;
        if p.weight_grams == 0 {
            return Err(invalid("`parcel.weightGrams` must be greater than 0"));
        }
        for (name, v) in [
            ("lengthCm", p.length_cm),
            ("widthCm", p.width_cm),
            ("heightCm", p.height_cm),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(invalid(format!("`parcel.{name}` must be greater than 0")));
            }
        }
        Ok(req)
    }
}

/// ISO 3166-1 alpha-2 codes currently assigned.
const ISO_COUNTRIES: &str = "AD AE AF AG AI AL AM AO AQ AR AS AT AU AW AX AZ BA BB BD BE BF BG BH BI BJ BL BM BN BO BQ BR \
BS BT BV BW BY BZ CA CC CD CF CG CH CI CK CL CM CN CO CR CU CV CW CX CY CZ DE DJ DK DM DO DZ EC EE EG EH ER ES ET FI FJ FK \
FM FO FR GA GB GD GE GF GG GH GI GL GM GN GP GQ GR GS GT GU GW GY HK HM HN HR HT HU ID IE IL IM IN IO IQ IR IS IT JE JM JO \
JP KE KG KH KI KM KN KP KR KW KY KZ LA LB LC LI LK LR LS LT LU LV LY MA MC MD ME MF MG MH MK ML MM MN MO MP MQ MR MS MT MU \
MV MW MX MY MZ NA NC NE NF NG NI NL NO NP NR NU NZ OM PA PE PF PG PH PK PL PM PN PR PS PT PW PY QA RE RO RS RU RW SA SB SC \
SD SE SG SH SI SJ SK SL SM SN SO SR SS ST SV SX SY SZ TC TD TF TG TH TJ TK TL TM TN TO TR TT TV TW TZ UA UG UM US UY UZ VA \
VC VE VG VI VN VU WF WS YE YT ZA ZM ZW";

fn is_iso_country(code: &str) -> bool {
    code.len() == 2
        && code.bytes().all(|b| b.is_ascii_uppercase())
        && ISO_COUNTRIES.split(' ').any(|c| c == code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn countries() {
        assert!(is_iso_country("JP"));
        assert!(is_iso_country("US"));
        assert!(!is_iso_country("jp"));
        assert!(!is_iso_country("XX"));
        assert!(!is_iso_country("JPN"));
        assert_eq!(ISO_COUNTRIES.split(' ').count(), 249);
    }
}
